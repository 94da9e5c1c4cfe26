"""The data order of a mixture beside one source's: dflash.train.batches.Schedule.micro_batch, per call.

    python -m bench --only schedule

At 10k, 100k and 1M sequences, for one source (no data.sources), a two-source mixture (80% and 20% of the
sequences at half an epoch each: the small source over-weighted, 2.5 cycles an epoch) and a five-source one (from
an under-weighted source of 40% at a tenth of an epoch to an over-weighted one of 5% at 30%). A global batch of 4
sequences x 8 processes x 4 micro-steps. Two figures each: `build_s`, the first micro-batch of an epoch (it builds
the epoch's order: median over three epochs), and `micro_batch_s`, the mean of a micro-batch after it (this
process's calls in a row, as a DataLoader worker makes them; the median over rounds, the three kinds in turn in
each round, so that a shared machine's drift falls on all three alike). Before issue 65 the mixture rebuilt its
order with a randperm per position on every call: 0.026 s a micro-batch at 1k sequences, 50 s at 100k.

The goal: a mixture's micro-batch within 1 ms at 1M sequences and within 2x of one source's.
"""

from __future__ import annotations

import time

from bench.measure import median, time_call
from dflash.train.batches import Schedule

SIZES = (10_000, 100_000, 1_000_000)
# per kind: (each source's fraction of the sequences, its weight); None = one source
KINDS = {"single": None,
         "two": ([0.8, 0.2], [0.5, 0.5]),
         "five": ([0.4, 0.3, 0.15, 0.1, 0.05], [0.1, 0.15, 0.2, 0.25, 0.3])}
BATCH_SIZE, WORLD, GRAD_ACCUM = 4, 8, 4
GOAL_MS, GOAL_RATIO = 1.0, 2.0


def shares_of(num_sequences: int, kind: str) -> list[tuple[list[int], float]] | None:
    """data.sources' shares for `kind`: each source a contiguous run of indices (the order does not care where)."""
    if KINDS[kind] is None:
        return None
    fractions, weights = KINDS[kind]
    bounds = [round(sum(fractions[:k]) * num_sequences) for k in range(len(fractions))] + [num_sequences]
    return [(list(range(bounds[k], bounds[k + 1])), w) for k, w in enumerate(weights)]


def build_time(s: Schedule, epochs=(1, 2, 3)) -> float:
    """Median seconds of an epoch's first micro-batch (the schedule holds another epoch's order before each)."""
    return median(time_call(lambda: s.micro_batch(e * s.steps_per_epoch, 0, 0)) for e in epochs)


def steady_time(s: Schedule, calls: int) -> float:
    """Mean seconds of a micro-batch over `calls` calls in a row within epoch 0, its order built before."""
    s.micro_batch(0, 0, 0)
    t = time.perf_counter()
    for k in range(calls):
        step, micro = divmod(k, GRAD_ACCUM)
        s.micro_batch(step % s.steps_per_epoch, micro, 3)  # one process's micro-batches, as its worker reads them
    return (time.perf_counter() - t) / calls


def schedule_costs(quick: bool, **_) -> dict:
    calls, rounds = (500, 3) if quick else (5000, 5)
    out: dict = {"batch": {"batch_size": BATCH_SIZE, "world": WORLD, "grad_accum": GRAD_ACCUM},
                 "kinds": {k: None if v is None else {"fractions": v[0], "weights": v[1]} for k, v in KINDS.items()},
                 "calls": calls, "rounds": rounds, "sizes": {}}
    for n in SIZES:
        schedules = {kind: Schedule(n, BATCH_SIZE, WORLD, GRAD_ACCUM, seed=0, shares=shares_of(n, kind))
                     for kind in KINDS}
        build = {kind: build_time(s) for kind, s in schedules.items()}
        steady = {kind: [] for kind in KINDS}
        for _ in range(rounds):
            for kind, s in schedules.items():
                steady[kind].append(steady_time(s, calls))
        steady = {kind: median(times) for kind, times in steady.items()}
        out["sizes"][str(n)] = {
            "build_s": {kind: round(t, 6) for kind, t in build.items()},
            "micro_batch_s": {kind: round(t, 8) for kind, t in steady.items()},
            "build_over_single": {kind: round(build[kind] / build["single"], 3) for kind in KINDS if kind != "single"},
            "micro_batch_over_single": {kind: round(steady[kind] / steady["single"], 3)
                                        for kind in KINDS if kind != "single"}}
        del schedules  # a 1M order and its sources' index lists, before the next size's
    largest = out["sizes"][str(SIZES[-1])]
    mixtures = [kind for kind in KINDS if kind != "single"]
    out["micro_batch_ms_at_largest"] = round(max(largest["micro_batch_s"][k] for k in mixtures) * 1e3, 5)
    out["mixture_over_single_at_largest"] = max(largest["micro_batch_over_single"][k] for k in mixtures)
    out["goal"] = (f"a mixture's micro-batch (two and five sources) within {GOAL_MS} ms at {SIZES[-1]:,} sequences "
                   f"and within {GOAL_RATIO}x of one source's")
    out["goal_met"] = (out["micro_batch_ms_at_largest"] <= GOAL_MS
                       and out["mixture_over_single_at_largest"] <= GOAL_RATIO)
    return out
