"""One training step (dflash.train.step): what it reads back from the device, the dtype the cached features
travel in, and the non-finite stop after the fact."""

import sys
from collections import Counter
from contextlib import contextmanager, nullcontext
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from dflash.drafter import blocks as packing
from dflash.errors import TrainingError
from dflash.train import loop
from dflash.train import step as stepping
from tests.conftest import tiny_job

READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "numpy", "nonzero", "argwhere",
         "masked_select", "unique"}
"""Tensor calls whose result is a host value, or whose shape only the device's data gives: on CUDA each waits
for the device's queue."""


class SyncCounter(TorchFunctionMode):
    """Counts, by where they were made, the tensor calls that would make the host wait for the device on CUDA.

    Counted: reading a value back (`item`, `tolist`, `bool()`/`int()`/`float()` of a tensor, `cpu`, `numpy`),
    data-dependent shapes (`nonzero`, a boolean-mask index, `masked_select`, `unique`), and, in dflash's own
    code, a `.to(device)` without `non_blocking` (a blocking host-to-device copy synchronises the stream;
    torch's and transformers' own `.to(x.device)` calls move device tensors to their own device, no copy).
    On a CPU every tensor lives on the "device", so what is left out must be named: `host(t)` says that `t`
    lives on the host on CUDA too, and `pause()` leaves out a region.
    """

    def __init__(self, host=lambda t: False):
        super().__init__()
        self.calls: Counter = Counter()
        self.host, self.paused = host, False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self.paused and self._syncs(name, args, kwargs):
            caller = sys._getframe(1)
            self.calls[f"{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}"] += 1
        return func(*args, **kwargs)

    def _syncs(self, name: str, args, kwargs) -> bool:
        if name == "__getitem__" and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            return any(torch.is_tensor(i) and i.dtype == torch.bool for i in index)
        if name == "to":
            to_device = any(isinstance(a, (torch.device, str)) for a in args[1:]) or "device" in kwargs
            ours = "/dflash/" in sys._getframe(2).f_code.co_filename
            return to_device and ours and not kwargs.get("non_blocking", False)
        return name in READS and not (args and torch.is_tensor(args[0]) and self.host(args[0]))

    @contextmanager
    def pause(self):
        self.paused = True
        try:
            yield
        finally:
            self.paused = False

    @property
    def total(self) -> int:
        return sum(self.calls.values())


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("step")


def job_for(workdir: Path, name: str, *overrides: str):
    return tiny_job("train", workdir, "eval.at_start=false", "eval.max_prompts=1", *overrides, target="tiny_qwen3_5",
                    name=name)


def test_a_step_of_four_micro_batches_reads_back_from_the_device_once(workdir, monkeypatch):
    """Everything train_step does once its micro-batches have come from the DataLoader (built on the host,
    outside the count) is counted: moving them, the features, forward, loss, backward, clip and update.
    Left out: AdamW's step counts (torch keeps `state["step"]` on the host unless capturable: their `.item()`
    is a host read on CUDA too) and the sdpa masks' chunk lengths, which the dense path, the CPU one, reads
    from the anchors (on CUDA training runs flex attention, whose masks read nothing back: the next test).
    Logging and checkpoints (log_every=100, a save at the end) happen outside train_step: a step that only
    trains waits once, for its non-finite check (the issue allows two)."""
    counts, active = [], {}
    real_step, real_masks = loop.train_step, packing.packed_attention_masks

    def counted_step(job, acc, m, *args):
        steps = lambda t: any(t is s.get("step") for s in m.optimizer.state.values())  # noqa: E731
        with SyncCounter(host=steps) as counter:
            active["counter"] = counter
            real_step(job, acc, m, *args)
        counts.append(counter.calls)

    def masks(blocks, layer_types, window, backend):
        with active["counter"].pause() if backend == "sdpa" else nullcontext():
            return real_masks(blocks, layer_types, window, backend)

    monkeypatch.setattr(loop, "train_step", counted_step)
    monkeypatch.setattr(packing, "packed_attention_masks", masks)
    loop.train(job_for(workdir, "syncs", "train.grad_accum=4", "train.log_every=100", "train.max_steps=3",
                       "train.save_every=100"))
    lines = Path(stepping.__file__).read_text().splitlines()
    check = next(i for i, line in enumerate(lines, start=1) if "bad_loss, bad_norm =" in line)
    assert counts == [{f"tolist at step.py:{check}": 1}] * 3


def test_flex_masks_are_built_without_reading_back():
    """The CUDA training path's BlockMasks (both mask kinds) come from the anchors on the device alone."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 290, (2, 300), generator=g)
    blocks = packing.pack_blocks(ids, torch.ones(2, 300, dtype=torch.bool), torch.tensor([300, 300]),
                                 [torch.arange(3, 280, 5), torch.arange(7, 250, 9)], 8, 299)
    with SyncCounter() as counter:
        masks = packing.packed_attention_masks(blocks, ["sliding_attention", "full_attention"], 64, "flex")
    assert set(masks) == {"sliding_attention", "full_attention"}
    assert counter.total == 0, dict(counter.calls)


def test_a_non_finite_micro_batch_is_named_after_the_steps_one_check(workdir, monkeypatch):
    """The check runs once, after the step's four backwards; the message still names the micro-batch (step 2,
    micro-batch 2: the 7th loss) and no update was made with it (the step-1 checkpoint is the last)."""
    real, calls = stepping.block_terms, {"n": 0}

    def poisoned(*args, **kwargs):
        calls["n"] += 1
        terms = real(*args, **kwargs)
        terms.loss_sum = terms.loss_sum * float("nan") if calls["n"] == 7 else terms.loss_sum
        return terms

    monkeypatch.setattr(stepping, "block_terms", poisoned)
    with pytest.raises(TrainingError, match=r"non-finite loss \(nan\) at step 2 \(epoch 0, micro-batch 2, sequences "
                                            r"\['tiny-.*step-000001 is untouched"):
        loop.train(job_for(workdir, "nan4", "train.grad_accum=4", "train.max_steps=3", "train.save_every=1"))
    assert calls["n"] == 8


@pytest.mark.parametrize("storage", ["bfloat16", "float8_e4m3fn"])
def test_cached_features_travel_in_their_stored_dtype_and_are_upcast_on_the_device(workdir, monkeypatch, storage):
    """batch_features gets the features as the cache stores them (half the bytes of float32 in bf16, a quarter
    in fp8 with its per-token scales) and returns float32, equal to the cache's own float32 read."""
    from dflash.data.cache import FeatureCache

    seen = []
    real = stepping.batch_features

    def spy(acc, target, drafter, batch):
        out = real(acc, target, drafter, batch)
        seen.append((batch, out))
        return out

    monkeypatch.setattr(stepping, "batch_features", spy)
    cache = workdir / f"cache-{storage}/features"
    loop.train(job_for(workdir, f"dtype-{storage}", f"features.storage={storage}", f"features.dir={cache}",
                       "train.max_steps=2", "train.batch_size=2", "train.save_every=100"))
    float32 = FeatureCache(cache, dtype=torch.float32)
    assert len(seen) == 2
    for batch, out in seen:
        assert batch.features.dtype == getattr(torch, storage)
        assert (batch.scales is not None) == (storage == "float8_e4m3fn")
        assert out.dtype == torch.float32 and out.shape == batch.features.shape
        for row, (i, length) in enumerate(zip(batch.index, batch.lengths.tolist())):
            assert torch.equal(out[row, :length], float32[i][2]) and not out[row, length:].any()
