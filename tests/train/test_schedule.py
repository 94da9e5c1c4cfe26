"""An epoch's data order (dflash.train.batches.Schedule) is built once per epoch and is, position for position, the
order the schedule gave before it was (issue 65): resumed runs and recorded runs depend on it."""

import pickle

import pytest
import torch

from dflash.train.batches import Schedule, seed_for


# The schedule as it was before issue 65, kept as the oracle: a fresh randperm for every position of every source's
# quota, then the epoch shuffled. Slow (quadratic), so the sizes below stay small. Do not change it: the order of
# every recorded and resumed run is this function's.
def reference_quotas(num_sequences, shares):
    exact = [share * num_sequences for _, share in shares]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: num_sequences - sum(counts)]:
        counts[i] += 1
    return counts


def reference_permutation(num_sequences, seed, shares, epoch):
    g = torch.Generator().manual_seed(seed_for(seed, "order", epoch))
    if shares is None:
        return torch.randperm(num_sequences, generator=g).tolist()
    picked = []
    for k, ((indices, _), quota) in enumerate(zip(shares, reference_quotas(num_sequences, shares))):
        start, n = epoch * quota, len(indices)
        for pos in range(start, start + quota):
            cycle = torch.Generator().manual_seed(seed_for(seed, "source", k, pos // n))
            picked.append(indices[int(torch.randperm(n, generator=cycle)[pos % n])])
    return [picked[i] for i in torch.randperm(len(picked), generator=g).tolist()]


def reference_micro_batch(s: Schedule, step, micro, rank):
    epoch, within = divmod(step, s.steps_per_epoch)
    perm = reference_permutation(s.num_sequences, s.seed, s.shares, epoch)
    start = within * s.global_batch + (micro * s.world + rank) * s.batch_size
    return epoch, [perm[(start + j) % s.num_sequences] for j in range(s.batch_size)]


def interleaved(sizes: list[int], weights: list[float], seed: int = 0) -> list[tuple[list[int], float]]:
    """Sources of these sizes and weights over sum(sizes) sequences, each source's indices scattered over the set
    (as data.sources' ids come from several stores), so an order that confused a source's position with a sequence
    index would show."""
    owner = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
    groups, at = [], 0
    for size, weight in zip(sizes, weights):
        groups.append((sorted(owner[at: at + size]), weight))
        at += size
    return groups


# (num_sequences, shares): one source; a mixture at its sizes' proportions; an under-weighted source (a cycle spans
# several epochs) beside over-weighted ones (several cycles an epoch); a source too light for a sequence an epoch
MIXTURES = {
    "single_1": (1, None),
    "single_97": (97, None),
    "single_1000": (1000, None),
    "two_even": (40, interleaved([20, 20], [0.5, 0.5])),
    "two_skewed": (10, [(list(range(6)), 0.3), (list(range(6, 10)), 0.7)]),
    "under_and_over": (60, interleaved([50, 7, 3], [0.1, 0.6, 0.3], seed=1)),
    "five": (101, interleaved([40, 30, 17, 9, 5], [0.1, 0.15, 0.2, 0.25, 0.3], seed=2)),
    "one_gets_none": (30, interleaved([27, 3], [0.999, 0.001], seed=3)),
}


@pytest.mark.parametrize("name", MIXTURES)
@pytest.mark.parametrize("seed", [0, 1, 2024])
def test_each_epochs_order_is_the_one_the_schedule_gave_before(name, seed):
    num_sequences, shares = MIXTURES[name]
    s = Schedule(num_sequences, batch_size=2, world=1, grad_accum=1, seed=seed, shares=shares)
    for epoch in (0, 1, 2, 3, 7, 12):
        assert s.permutation(epoch) == reference_permutation(num_sequences, seed, shares, epoch), (name, seed, epoch)


def test_the_mixtures_above_span_cycles_both_ways():
    """The cases hold what the brief of the oracle test asks for: a source whose quota is under one cycle (a cycle
    spans epochs), sources whose quota spans several cycles an epoch, and a source with a quota of 0."""
    num_sequences, shares = MIXTURES["under_and_over"]
    quotas = Schedule(num_sequences, 1, 1, 1, 0, shares).quotas()
    sizes = [len(indices) for indices, _ in shares]
    assert quotas[0] < sizes[0] and quotas[1] > 2 * sizes[1] and quotas[2] > 2 * sizes[2]
    num_sequences, shares = MIXTURES["one_gets_none"]
    assert Schedule(num_sequences, 1, 1, 1, 0, shares).quotas() == [30, 0]


@pytest.mark.parametrize("name", ["single_97", "two_skewed", "under_and_over", "five"])
@pytest.mark.parametrize("batch_size,world,grad_accum", [(1, 1, 1), (3, 2, 2), (4, 3, 1), (2, 1, 8)])
def test_every_micro_batch_is_the_one_the_schedule_gave_before(name, batch_size, world, grad_accum):
    num_sequences, shares = MIXTURES[name]
    s = Schedule(num_sequences, batch_size, world, grad_accum, seed=5, shares=shares)
    steps = range(3 * s.steps_per_epoch + 1)  # across epoch boundaries, the topped-up last batch included
    for step in steps:
        for micro in range(grad_accum):
            for rank in range(world):
                assert s.micro_batch(step, micro, rank) == reference_micro_batch(s, step, micro, rank), \
                    (name, step, micro, rank)


def test_the_order_is_pinned_to_its_values():
    """The first positions of two orders, as literal values: the oracle above runs on the same torch.randperm, so
    this is what notices a torch release (or a change of both) moving every recorded run's order."""
    assert Schedule(1000, 2, 1, 1, seed=0).permutation(0)[:8] == [73, 965, 108, 39, 812, 241, 577, 722]
    num_sequences, shares = MIXTURES["under_and_over"]
    assert Schedule(num_sequences, 2, 1, 1, 0, shares).permutation(3)[:8] == [30, 31, 30, 42, 31, 46, 54, 0]


def test_an_epochs_order_is_built_once_with_one_randperm_per_source_and_cycle(monkeypatch):
    """10,000 sequences in two sources, one over-weighted (2,000 sequences at half an epoch: 2.5 cycles) and one
    under-weighted: the epoch's order costs one randperm per cycle it touches and one for the shuffle, and the
    micro-batches after the first read it without drawing again, until the next epoch."""
    shares = interleaved([8000, 2000], [0.5, 0.5])
    s = Schedule(10_000, batch_size=4, world=2, grad_accum=2, seed=0, shares=shares)
    calls = []
    randperm = torch.randperm
    monkeypatch.setattr(torch, "randperm", lambda n, **kw: (calls.append(n), randperm(n, **kw))[1])
    s.micro_batch(0, 0, 0)
    # epoch 0: source 0 reads positions 0..4999 (cycle 0), source 1 0..4999 (cycles 0, 1, 2), then the shuffle
    assert sorted(calls) == [2000, 2000, 2000, 8000, 10_000]
    for step in range(1, 50):
        s.micro_batch(step, 1, 1)
    assert len(calls) == 5 and s.order(0) is s.order(0)
    s.micro_batch(s.steps_per_epoch, 0, 0)  # epoch 1: source 0 positions 5000..9999 (cycles 0, 1)
    assert sorted(calls[5:]) == [2000, 2000, 2000, 8000, 8000, 10_000]


def test_a_schedule_pickles_without_its_cached_order_and_reads_the_same():
    """A DataLoader worker gets the schedule pickled (spawn start method): it builds its epoch's order itself, and
    a schedule whose cached epoch is another reads the right one."""
    num_sequences, shares = MIXTURES["five"]
    s = Schedule(num_sequences, 3, 2, 2, seed=1, shares=shares)
    first = s.micro_batch(0, 1, 1)
    copy = pickle.loads(pickle.dumps(s))
    assert copy._cached is None and s._cached is not None and copy == s
    assert copy.micro_batch(0, 1, 1) == first
    later = s.micro_batch(5 * s.steps_per_epoch, 0, 0)  # another epoch replaces the cached one, and back
    assert s.micro_batch(0, 1, 1) == first and s.micro_batch(5 * s.steps_per_epoch, 0, 0) == later
    assert later == reference_micro_batch(s, 5 * s.steps_per_epoch, 0, 0)
