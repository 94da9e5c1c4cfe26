"""Online training's up-front check that the whole target fits each process's device beside the drafter."""

from dataclasses import replace

import pytest
import torch

from dflash.drafter.build import build_drafter
from dflash.errors import ConfigError
from dflash.target import placement
from dflash.target.placement import GiB
from dflash.train import fit, sources
from tests.conftest import compose

H100 = 79.2 * GiB  # what an "80 GB" GPU reports
H200 = 139.8 * GiB


class Loaded(Exception):
    """Raised by a stand-in load_target: the check let the run through to loading."""


@pytest.fixture
def no_loading(monkeypatch):
    def load(*args, **kwargs):
        raise Loaded

    monkeypatch.setattr(sources, "load_target", load)



def target_for(job, device):
    """sources.training_target as train() calls it: the checkpointing mode resolved first."""
    return sources.training_target(job, device, fit.resolve_checkpointing(job, device))

def test_qwen3_6_27b_online_under_ddp_on_80gb_is_refused_before_loading(monkeypatch, no_loading):
    """dflash/plan/memory.py's figures: a 50.1 GiB target beside a 1.835 B-parameter drafter's 34.2 GiB of DDP state
    is more than an 80 GB GPU holds; an H200 holds it, and so does an 80 GB GPU under FSDP."""
    import transformers

    from dflash.plan.targets import TARGETS

    cls, dims = TARGETS["qwen3_6_27b"]
    monkeypatch.setattr(fit, "read_config", lambda cfg: ("Qwen/Qwen3.6-27B", None, getattr(transformers, cls)(**dims)))
    monkeypatch.setattr(fit, "world_size", lambda: 8)
    counted = placement.parameter_count(getattr(transformers, cls)(**dims))
    assert counted == 26_895_998_464  # 50.1 GiB in bf16, the plan's "target model (online)"
    monkeypatch.setattr(placement, "parameter_count", lambda config, trust_remote_code=False, tensor_parallel=1: counted)
    job = compose("train", ["experiment=qwen3_6_27b", "train.mode=online", "train.distributed=ddp",
                            "data.prompts=x.jsonl", "target.tensor_parallel=1", "data.max_length=3072",
                            "train.gradient_checkpointing=full"])  # the whole target, at the paper's length
    memory = {"gib": H100}
    monkeypatch.setattr(placement, "device_memory", lambda device: memory["gib"])
    with pytest.raises(ConfigError) as refused:
        target_for(job, torch.device("cuda", 0))
    message = str(refused.value)
    assert "target qwen3_6_27b 50.1 GiB (26.90 B parameters x 2 bytes, bfloat16)" in message
    assert ("drafter and optimizer 34.2 GiB (1.835 B parameters: float32 weights, gradients, AdamW moments, DDP "
            "gradient buckets)") in message
    assert "= 86.3 GiB, more than the device's 79.2 GiB" in message
    assert "train.mode=offline" in message and "train.distributed=fsdp" in message and "H200" in message
    memory["gib"] = H200
    with pytest.raises(Loaded):
        target_for(job, torch.device("cuda", 0))
    memory["gib"] = H100
    job.train.distributed = "fsdp"  # 1.835 B x 16 bytes / 8 + the gathered bf16 weights: 6.8 GiB
    with pytest.raises(Loaded):
        target_for(job, torch.device("cuda", 0))


def test_tiny_online_target_is_refused_by_a_byte_and_loaded_when_it_fits(tiny_targets, monkeypatch):
    """The figures are the target's parameters x target.dtype bytes and the drafter's 16 bytes a parameter
    (one process): one byte less of device memory than that plus the allowance refuses, that much loads."""
    job = compose("train", ["debug=tiny", "train.mode=online"])
    loaded = tiny_targets["tiny_qwen3"]
    target_bytes = sum(p.numel() for p in loaded.model.parameters()) * 4
    drafter = build_drafter(job.drafter, job.layers, loaded)
    need = target_bytes + sum(p.numel() for p in drafter.parameters()) * 16 + placement.ALLOWANCE
    memory = {"bytes": need - 1}
    monkeypatch.setattr(placement, "device_memory", lambda device: memory["bytes"])
    with pytest.raises(ConfigError, match=rf"target tiny_qwen3 {placement.gib(target_bytes)} .*float32\)"):
        target_for(job, torch.device("cpu"))
    memory["bytes"] = need
    monkeypatch.setattr(sources, "check_length_fit", lambda job, device, mode, plan=None: None)
    target, _ = target_for(job, torch.device("cpu"))
    assert target.model is not None


def test_drafter_state_per_process(dflash_home):
    job = compose("train", ["debug=tiny", "train.mode=online"])
    assert fit.drafter_state(job.train, 1000, 1)[0] == 16_000
    assert fit.drafter_state(job.train, 1000, 8)[0] == 20_000  # DDP's gradient buckets
    job.train.distributed = "fsdp"
    assert fit.drafter_state(job.train, 1000, 8)[0] == 2_000 + 2_000  # sharded state + gathered bf16 weights
    job.train.mixed_precision = "no"
    assert fit.drafter_state(job.train, 1000, 8)[0] == 2_000 + 4_000


def test_a_max_length_whose_planned_step_does_not_fit_is_refused_in_one_line_before_loading(monkeypatch, no_loading):
    """Qwen3.6-27B online at 32768 tokens, the whole target on each of 8 GPUs (FSDP, checkpointing, 512 anchors):
    the plan's step peaks at 83.3 GiB, more than an 80 GB GPU's 79.2, though the target and the drafter's state
    alone fit; refused in one line naming data.max_length, the peak and the fixes with their figures. At 3072
    tokens, on an H200, or on a CPU (nothing is checked there) the run goes on to loading."""
    import transformers

    from dflash.plan.compose import compose as plan_groups
    from dflash.plan.memory import max_anchors, peak
    from dflash.plan.report import build
    from dflash.plan.targets import TARGETS

    cls, dims = TARGETS["qwen3_6_27b"]
    monkeypatch.setattr(fit, "read_config", lambda cfg: ("Qwen/Qwen3.6-27B", None, getattr(transformers, cls)(**dims)))
    monkeypatch.setattr(fit, "world_size", lambda: 8)
    overrides = ["experiment=qwen3_6_27b", "train.mode=online", "train.distributed=fsdp",
                 "train.gradient_checkpointing=full", "train.num_anchors=512", "target.tensor_parallel=1"]
    job = compose("train", [*overrides, "data.max_length=32768", "data.prompts=x.jsonl"])
    memory = {"gib": H100}
    monkeypatch.setattr(placement, "device_memory", lambda device: memory["gib"] if device.type == "cuda" else None)
    with pytest.raises(ConfigError) as refused:
        target_for(job, torch.device("cuda", 0))
    message = str(refused.value)
    drafter, shape, setup = build(plan_groups([*overrides, "data.max_length=32768"]), world=8)
    assert f"{peak(shape, setup)[0] / GiB:.1f} GiB" == "83.3 GiB"  # the plan's figure, the same
    assert "\n" not in message and message.startswith("data.max_length=32768: ")
    assert "planned to peak at 83.3 GiB a process" in message and "more than cuda:0's 79.2 GiB" in message
    most = max_anchors(shape, setup, H100)  # 141 at the plan's 80 GiB; a GPU's 79.2 GiB holds fewer
    assert f"train.num_anchors={most} (the most that fit)" in message and most == 51
    assert "set data.max_length=17664 (the longest that fits), or train.num_anchors=" in message
    at = lambda n: peak(shape, replace(setup, ctx_len=n))[0]  # noqa: E731
    assert at(17664) <= H100 < at(17664 + 256)
    for line in ("gradient_checkpointing", "distributed=fsdp"):  # set already: not offered
        assert line not in message.partition("; set ")[2]
    for device, gib, length in ((torch.device("cuda", 0), H100, 3072), (torch.device("cuda", 0), H200, 32768),
                                (torch.device("cpu"), H100, 32768)):
        memory["gib"] = gib
        job.data.max_length = length
        with pytest.raises(Loaded):
            target_for(job, device)


def test_gradient_checkpointing_auto_is_chosen_by_the_plan_for_the_device(monkeypatch, no_loading, caplog):
    """train.gradient_checkpointing=auto (Qwen3.6-27B's drafter offline at 3072 tokens): off on a device the plan's
    peak without checkpointing fits, selective where only its peak and full checkpointing's fit, full where only
    that fits (or nothing does), off on a CPU; one log line says which and why, with the three peaks and the
    device's memory. The mode is returned, the job left as it was (auto); off, selective and full are taken as
    given."""
    import logging

    import transformers

    from dflash.plan.compose import compose as plan_groups
    from dflash.plan.memory import choose_checkpointing, peak
    from dflash.plan.report import build
    from dflash.plan.targets import TARGETS

    cls, dims = TARGETS["qwen3_6_27b"]
    monkeypatch.setattr(fit, "read_config", lambda cfg: ("Qwen/Qwen3.6-27B", None, getattr(transformers, cls)(**dims)))
    monkeypatch.setattr(fit, "world_size", lambda: 1)
    overrides = ["experiment=qwen3_6_27b", "train.mode=offline", "train.distributed=ddp", "data.max_length=3072"]
    _, shape, setup = build(plan_groups(overrides))
    off, selective, full = (peak(shape, replace(setup, checkpointing=c))[0] for c in (False, "selective", True))
    assert full < selective < off
    memory = {}
    monkeypatch.setattr(placement, "device_memory", lambda device: memory["bytes"] if device.type == "cuda" else None)
    cases = [(torch.device("cuda", 0), off + GiB, "off", "off: the step fits without it"),
             (torch.device("cuda", 0), (selective + off) / 2, "selective",
              "selective: the step fits keeping its layers' matmul outputs"),
             (torch.device("cuda", 0), (full + selective) / 2, "full", "true (full): the step does not fit with less"),
             (torch.device("cpu"), None, "off", "off (not a CUDA device)")]
    for device, budget, chosen, why in cases:
        memory["bytes"] = budget
        job = compose("train", [*overrides, "data.prompts=x.jsonl", "train.gradient_checkpointing=auto"])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="dflash.train.fit"):
            assert fit.resolve_checkpointing(job, device) == chosen
        assert job.train.gradient_checkpointing == "auto"  # nothing written back into the job
        [line] = [r.getMessage() for r in caplog.records if "gradient_checkpointing=auto" in r.getMessage()]
        assert line.startswith(f"train.gradient_checkpointing=auto on {device}: {why}")
        if budget is not None:
            assert (f"planned peak {off / GiB:.1f} GiB without it, {selective / GiB:.1f} GiB selective, "
                    f"{full / GiB:.1f} GiB full; the device has {budget / GiB:.1f} GiB") in line
    assert choose_checkpointing(shape, setup, full - 1)[0] is True  # fits no way: full (check_length_fit refuses)
    for given in ("off", "selective", "full"):
        job = compose("train", [*overrides, "data.prompts=x.jsonl", f"train.gradient_checkpointing={given}"])
        assert fit.resolve_checkpointing(job, torch.device("cuda", 0)) == given
    assert compose("train", ["data.prompts=x.jsonl"]).train.gradient_checkpointing == "auto"  # the default


@pytest.mark.parametrize("bad", ["maybe", "1"])
def test_a_bad_gradient_checkpointing_is_refused_in_one_line(bad):
    with pytest.raises(Exception) as refused:
        compose("train", [f"train.gradient_checkpointing={bad}"])
    cause = next(e for e in (refused.value, refused.value.__cause__, refused.value.__context__)
                 if isinstance(e, ConfigError))
    assert "\n" not in str(cause) and str(cause).startswith("train.gradient_checkpointing=")
    assert str(cause).endswith("is not valid; expected one of off, selective, full, auto")


@pytest.mark.parametrize("key, old, new", [("gradient_checkpointing", "true", "full"),
                                           ("gradient_checkpointing", "false", "off"),
                                           ("compile", "true", "model"), ("compile", "false", "off")])
def test_the_old_true_and_false_are_read_as_the_enum_with_a_deprecation_note(key, old, new, caplog):
    """train.gradient_checkpointing and train.compile were true/false (and more); they are string enums now. The
    old spellings still compose, to the mode they meant, with one line saying what to write (and, for off, that
    YAML reads an unquoted off as false)."""
    import logging

    with caplog.at_level(logging.WARNING, logger="dflash.config"):
        assert getattr(compose("train", [f"train.{key}={old}"]).train, key) == new
    [line] = [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]
    assert line.startswith(f"train.{key}={old} is deprecated: write train.{key}={new}")
    assert ('in YAML quoted, "off"' in line) == (new == "off")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="dflash.config"):
        assert getattr(compose("train", [f"train.{key}={new}"]).train, key) == new
    assert "deprecated" not in caplog.text
