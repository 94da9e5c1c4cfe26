"""Typed configuration: one dataclass per concern, registered with Hydra's ConfigStore.

The YAML groups under ``conf/`` are merged onto these schemas, so an unknown key or a value
of the wrong type fails at compose time, and the cross-field checks in ``__post_init__`` run
when the entry points call ``OmegaConf.to_object``. Library code only ever sees these
dataclasses, never a ``DictConfig``. The schemas are grouped by concern (model.py, data.py,
run.py, plan.py); everything is importable from here. dflash.config imports nothing from the rest of
dflash but the exception classes of dflash.errors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from dflash.config.checks import ConfigError
from dflash.config.data import CompletionsConfig, DataConfig, FeaturesConfig, ToolsConfig
from dflash.config.model import (DEFAULT_GAMMA, DrafterConfig, LayersConfig, LossConfig, NoiseConfig,
                                 SelectorLossConfig, TargetConfig)
from dflash.config.plan import PlanConfig
from dflash.config.renamed import RENAMED, migrate_settings, migrate_tree, refuse_renamed
from dflash.config.run import (DecodeConfig, EvalConfig, LoggerConfig, OptimConfig, ProvenanceConfig, RunConfig,
                               ServingModelConfig, SuiteConfig, TrainConfig)

__all__ = ["DEFAULT_GAMMA", "RENAMED", "CompletionsConfig", "ConfigError", "DataConfig", "DecodeConfig",
           "DrafterConfig", "EvalConfig", "FeaturesConfig", "JobConfig", "LayersConfig", "LoggerConfig", "LossConfig",
           "NoiseConfig", "OptimConfig", "PlanConfig", "ProvenanceConfig", "ReportConfig", "RunConfig",
           "SelectorLossConfig", "ServingModelConfig", "SuiteConfig", "TargetConfig", "ToolsConfig", "TrainConfig",
           "migrate_settings", "migrate_tree", "refuse_renamed", "register_configs"]


@dataclass
class JobConfig:
    """Groups shared by every entry point, so one command line works for all three."""

    target: TargetConfig = MISSING
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    layers: LayersConfig = field(default_factory=LayersConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = MISSING
    features: FeaturesConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    provenance: ProvenanceConfig = field(default_factory=ProvenanceConfig)
    checkpoint: str = "latest"
    """evaluate.py: latest, best, stepN / stepNk, or a drafter directory (z-lab layout)."""


@dataclass
class ReportConfig:
    """python -m dflash.report: compare run folders without the W&B UI."""

    runs: Any = field(default_factory=lambda: ["all"])
    """Run names under `root`, run folders, or sweep folders (their runs), as a list; all = every run."""
    root: str = "runs"
    """Folder holding the run folders."""
    out: str | None = None
    """Where report.md/html and the PNGs go; null = <root>/reports/<run names>."""

    def __post_init__(self) -> None:
        if isinstance(self.runs, str):
            self.runs = [self.runs]
        if not self.runs or not all(isinstance(r, str) and r for r in self.runs):
            raise ConfigError(f"runs={self.runs!r}: give run names, e.g. runs=[run_a,run_b], or runs=all")


def register_configs() -> None:
    """Register the schemas so conf/*.yaml are validated against them (`defaults: [schema]`)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=JobConfig)
    ConfigStore.instance().store(name="report_schema", node=ReportConfig)
