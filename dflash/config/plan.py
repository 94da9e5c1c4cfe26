"""The plan's own keys (`python -m dflash.plan`): what a memory and cost plan needs beside the run's config groups,
given on its command line beside train.py's overrides (`gpu_gb=[80,141] world_size=8 ...`)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from dflash.config.checks import ConfigError


@dataclass
class PlanConfig:
    """The plan's keys; every other argument is one of train.py's overrides."""

    gpu_gb: list[float] = field(default_factory=lambda: [80, 141])
    """GPU memory in GiB, one size or a list: the plan judges each."""
    world_size: int = 1
    """Data-parallel processes of the run."""
    allowance_gb: float = 2.0
    """GiB a process holds besides the step (CUDA context, NCCL)."""
    fragmentation: float = 0.1
    """Share of the peak lost to the caching allocator."""
    sequences: int = 0
    """Training sequences; 0: the prompts data.prompts holds, else the DFlash paper's ~800K."""
    tokens_per_sequence: int = 0
    """Tokens a sequence; 0: the paper's ~1.2B tokens / 800K (1500), at most data.max_length."""
    mfu: float = 0.0
    """Model FLOPs utilisation of a training step; 0: measured, read from mfu_results (the experiment preset's own
    step where measured, else the median), 0.35 where nothing is measured."""
    mfu_results: str = ""
    """Folder of GPU check results (JSON) the MFU is read from; empty: this checkout's bench/results."""
    peak_tflops: float = 989.0
    """The GPU's dense bf16 TFLOP/s (989: H100 and H200 SXM)."""
    disk_tb: float = 20.0
    """TB of disk for a feature cache: offline training is recommended only where the cache fits."""
    concurrency: list[float] = field(default_factory=list)
    """Requests in flight when served; given, the plan prints the serving section instead of the training plan."""
    gpu: str = "h200"
    """The GPU the serving section models (dflash.plan.serving.GPUS)."""
    tau: str = ""
    """The drafter's acceptance length for the serving section: a number, an evaluation's summary.json, or
    <references>:<benchmark> (e.g. dflash_paper:gsm8k); empty: no speedup, only the tau each shape needs."""
    context: int = 1024
    """Tokens of context a served request has."""
    output_tokens: int = 512
    """Tokens a served request generates."""
    overhead_ms: float = 0.0
    """The serving engine's own time a step, in ms."""

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def set(self, key: str, value: str) -> None:
        """Set one key from its command-line text (`gpu_gb=[80,141]`, `world_size=8`): lists as floats, the rest as
        the field's type; a value that does not parse is refused naming the key."""
        default = getattr(PlanConfig(), key)
        kind = type(default)
        try:
            if kind is list:
                parsed = [float(v) for v in value.strip("[]").split(",") if v.strip()]
            elif kind is int:
                parsed = int(float(value))
            else:
                parsed = kind(value)
        except ValueError:
            example = "[80,141]" if key == "gpu_gb" else "[1,8,32]" if kind is list else default
            what = "a list of numbers" if kind is list else "a number"
            raise ConfigError(f"python -m dflash.plan: {key}={value} is not {what}; e.g. {key}={example}") from None
        setattr(self, key, parsed)
