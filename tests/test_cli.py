"""The entry points' shared start-up and end (dflash.cli): the compile caches, the process groups ended."""

import os

import pytest
from omegaconf import OmegaConf

from dflash.cli import use_compile_caches
from dflash.config import ConfigError, RunConfig
from dflash.layout import home

VARS = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@pytest.fixture
def unset(monkeypatch, tmp_path):
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    for var in VARS:
        monkeypatch.delenv(var, raising=False)
    return tmp_path


def test_the_caches_go_under_the_home_when_unset(unset):
    assert use_compile_caches() == {"TRITON_CACHE_DIR": str(unset / "home/compile-cache/triton"),
                                    "TORCHINDUCTOR_CACHE_DIR": str(unset / "home/compile-cache/inductor")}
    assert home() == unset / "home" and all(os.environ[v].startswith(str(unset / "home")) for v in VARS)


def test_run_compile_cache_moves_them_and_exported_values_are_kept(unset, monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/users/own/triton")
    chosen = use_compile_caches(str(unset / "shared"))
    assert chosen == {"TRITON_CACHE_DIR": "/users/own/triton", "TORCHINDUCTOR_CACHE_DIR": str(unset / "shared/inductor")}
    assert use_compile_caches(str(unset / "other")) == chosen  # set once: every later process of a launch agrees


def test_the_entry_points_set_them_as_they_start(unset):
    """to_job (train.py, evaluate.py, extract.py) sets them from run.compile_cache before anything compiles."""
    from hydra import compose, initialize_config_dir

    from dflash.cli import to_job
    from dflash.config import register_configs

    register_configs()
    conf = os.path.join(os.path.dirname(__file__), "..", "conf")
    with initialize_config_dir(config_dir=os.path.abspath(conf), version_base="1.3"):
        cfg = compose("train", overrides=[f"run.compile_cache={unset / 'c'}"])
    to_job(cfg)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(unset / "c/inductor")


@pytest.mark.parametrize("bad, message", [(" ", "run.compile_cache is empty"), ("file", "is a file")])
def test_a_bad_compile_cache_is_refused(tmp_path, bad, message):
    if bad == "file":
        bad = tmp_path / "f"
        bad.write_text("")
    with pytest.raises(ConfigError, match=message):
        OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), {"compile_cache": str(bad)}))


def test_a_finished_run_destroys_the_process_group(tmp_path):
    """After the job succeeded, `run` destroys the process group (dflash.dist.finish): left to the interpreter's exit,
    gloo's threads aborted a process that had printed its result (tests/target/tp_probe, 2 of 6 launches under
    load); a failed job exits 2 without waiting for anyone."""
    import torch.distributed as td

    from dflash.cli import run

    def refuse(job):
        raise ConfigError("no")

    td.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        assert run(lambda job: job + 1, 6) == 7
        assert not td.is_initialized()
        with pytest.raises(SystemExit) as e:
            run(refuse, None)
        assert e.value.code == 2
    finally:
        if td.is_initialized():
            td.destroy_process_group()


@pytest.mark.parametrize("script, given, said", [
    ("train.py", "eval.temperature=1.0", "eval.temperature is now eval.decode.temperature: write "
                                         "eval.decode.temperature=1.0"),
    ("evaluate.py", "eval.suite=zlab", "eval.suite is now eval.suite.name: write eval.suite.name=zlab"),
    ("train.py", "+loss.selector_shrink=0.5", "write +loss.selector.shrink=0.5"),
    ("extract.py", "eval.serving_gpu=h100", "eval.serving_gpu is now eval.serving.gpu")])
def test_a_key_that_moved_into_a_sub_group_is_refused_in_one_line_naming_the_new(script, given, said):
    """eval's sampling keys went to eval.decode, a suite's to eval.suite, the serving model's to eval.serving and the
    selector's loss keys to loss.selector: the old key on the command line stops the entry point before Hydra
    parses (Hydra would only say the key is not in the config), exit 2, one line naming the new key."""
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, str(repo / script), given], capture_output=True, text=True, cwd=repo,
                         env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"})
    assert out.returncode == 2 and said in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr


def test_every_moved_key_names_a_key_of_todays_schema():
    """RENAMED's new names are keys of the schema, and no old name is."""
    from dataclasses import asdict

    from dflash.config import RENAMED, EvalConfig, LossConfig

    def keys(tree: dict, prefix: str):
        for k, v in tree.items():
            yield from keys(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}"]

    schema = {*keys(asdict(EvalConfig()), "eval."), *keys(asdict(LossConfig()), "loss.")}
    assert set(RENAMED.values()) <= schema and not set(RENAMED) & schema
