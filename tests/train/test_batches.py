"""Which sequences each process reads at each step (dflash.train.batches.Schedule, seed_for) and what a Batch
carries to the device."""

import os
import subprocess
import sys

import pytest
import torch

from dflash.train.batches import Schedule, seed_for
from tests.conftest import REPO


def epoch_in_order(s: Schedule, epoch: int = 0) -> list[int]:
    """Every sequence index read in one epoch, by step, then micro-step, then rank."""
    seen = []
    for within in range(s.steps_per_epoch):
        for micro in range(s.grad_accum):
            for rank in range(s.world):
                e, index = s.micro_batch(epoch * s.steps_per_epoch + within, micro, rank)
                assert e == epoch
                seen += index
    return seen


def test_global_batch_and_steps_per_epoch():
    s = Schedule(num_sequences=10, batch_size=2, world=3, grad_accum=4, seed=0)
    assert s.global_batch == 24 and s.steps_per_epoch == 1  # fewer sequences than a global batch
    s = Schedule(num_sequences=10, batch_size=1, world=2, grad_accum=2, seed=0)
    assert s.global_batch == 4 and s.steps_per_epoch == 3
    assert Schedule(num_sequences=12, batch_size=2, world=2, grad_accum=3, seed=0).steps_per_epoch == 1


def test_an_epoch_reads_every_sequence_and_tops_up_the_last_batch_from_its_start():
    s = Schedule(num_sequences=10, batch_size=1, world=2, grad_accum=2, seed=3)
    perm = s.permutation(0)
    assert sorted(perm) == list(range(10))
    # 3 steps x 4 sequences = 12 slots: the whole permutation, then its first two again
    assert epoch_in_order(s) == perm + perm[:2]


@pytest.mark.parametrize("step", [0, 1, 5])
def test_micro_batches_of_one_step_are_disjoint(step):
    s = Schedule(num_sequences=12, batch_size=2, world=2, grad_accum=3, seed=0)
    batches = [s.micro_batch(step, micro, rank)[1] for micro in range(3) for rank in range(2)]
    assert all(len(b) == 2 for b in batches)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(12))  # no sequence twice, none left out


def test_data_does_not_depend_on_the_number_of_processes():
    two = Schedule(num_sequences=9, batch_size=1, world=2, grad_accum=2, seed=1)
    one = Schedule(num_sequences=9, batch_size=2, world=1, grad_accum=2, seed=1)
    for step in range(2 * one.steps_per_epoch):  # across an epoch boundary
        for micro in range(2):
            epoch, both = one.micro_batch(step, micro, 0)
            parts = [two.micro_batch(step, micro, rank) for rank in range(2)]
            assert [e for e, _ in parts] == [epoch, epoch]
            assert parts[0][1] + parts[1][1] == both


def test_every_epoch_has_its_own_seeded_order():
    s = Schedule(num_sequences=50, batch_size=2, world=1, grad_accum=1, seed=0)
    orders = [s.permutation(e) for e in range(3)]
    assert all(sorted(o) == list(range(50)) for o in orders)
    assert orders[0] != orders[1] != orders[2] != orders[0]
    assert Schedule(50, 4, 2, 1, seed=0).permutation(1) == orders[1]  # the order depends on the seed only
    assert Schedule(50, 2, 1, 1, seed=1).permutation(0) != orders[0]
    # the first step of epoch 1 reads epoch 1's order
    assert s.micro_batch(s.steps_per_epoch, 0, 0) == (1, orders[1][:2])
    assert epoch_in_order(s, 1) == orders[1]


def test_seed_for_is_deterministic_across_processes():
    assert seed_for(0, "order", 1) == seed_for(0, "order", 1)
    assert len({seed_for(0, "order", 1), seed_for(1, "order", 1), seed_for(0, "order", 2),
                seed_for(0, "anchors", 1), seed_for(0, "order", 1, 0)}) == 5
    assert 0 <= seed_for(0, "anchors", 1, 7) < 2**63  # fits torch.Generator.manual_seed
    # not Python's hash(): the same in a fresh interpreter with another hash seed, and across
    # releases (a changed value would change the data order of every resumed run)
    code = "from dflash.train.batches import seed_for; print(seed_for(0, 'order', 0), seed_for(0, 'anchors', 1, 7))"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONHASHSEED": "123"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == [str(seed_for(0, "order", 0)), str(seed_for(0, "anchors", 1, 7))]
    assert seed_for(0, "order", 0) == 2094333682667709378


class FeatureSource:
    """Three sequences of lengths 7, 5, 9 with bfloat16 features [T, 2*4] (two layers of width 4), as
    CachedSource gives them: (input_ids, loss_mask, features, scales)."""

    lengths = (7, 5, 9)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i):
        n = self.lengths[i]
        g = torch.Generator().manual_seed(i)
        mask = torch.arange(n) >= 2
        return torch.randint(0, 50, (n,), generator=g), mask, torch.randn(n, 8, generator=g).bfloat16(), None

    def id_of(self, i: int) -> str:
        return f"seq-{i}"


def feature_batch():
    from dflash.train.batches import MicroBatches

    schedule = Schedule(num_sequences=3, batch_size=3, world=1, grad_accum=1, seed=0)
    return MicroBatches(FeatureSource(), schedule, rank=0, start_step=0, total_steps=1, num_anchors=3, block_size=4,
                        mask_token_id=99, gamma=4.0)[0]


def tensors_of(batch) -> dict:
    """Every tensor of a Batch, its packed blocks' included, by field name."""
    import dataclasses

    out = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch) if torch.is_tensor(getattr(batch, f.name))}
    out.update({f"blocks.{f.name}": getattr(batch.blocks, f.name) for f in dataclasses.fields(batch.blocks)
                if torch.is_tensor(getattr(batch.blocks, f.name))})
    return out


def test_the_data_loaders_pinning_pins_every_tensor_of_a_batch(monkeypatch):
    """DataLoader(pin_memory=True) pins tensors and objects with a pin_memory() method, nothing else: a Batch
    has one, which pins its tensors, the packed blocks' too (pinning needs CUDA: here Tensor.pin_memory is
    replaced by a recording copy; tests/bench/gpu/test_steps.py checks real pinning)."""
    from torch.utils.data._utils.pin_memory import pin_memory

    from dflash.train.batches import Batch

    batch = feature_batch()
    pinned = []

    def fake_pin(self, *args, **kwargs):
        pinned.append(self.clone())
        return pinned[-1]

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    out = pin_memory(batch)
    assert isinstance(out, Batch) and out is not batch
    before, after = tensors_of(batch), tensors_of(out)
    assert before.keys() == after.keys() and {"features", "label_rows", "blocks.labels"} <= after.keys()
    assert len(pinned) == len(after) and all(any(t is p for p in pinned) for t in after.values())
    assert all(torch.equal(before[k], after[k]) and before[k].dtype == after[k].dtype for k in before)
    assert (out.ids, out.weight_sum, out.num_tokens, out.num_blocks) == (batch.ids, batch.weight_sum, 21, 8)
    assert out.features.dtype == torch.bfloat16  # as stored: the device upcasts
