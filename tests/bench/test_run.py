"""The benchmarks still run against the library (a smoke test: quick sizes, the cheap suites only)."""

import pytest
import torch

from bench import suites


def test_cheap_benchmarks_run_and_report_their_figures():
    out = suites.bytes_per_token(quick=True)
    assert 0.98 <= out["bf16_over_bound"] <= 1.02 and out["fp8_over_bf16"] < 0.52
    out = suites.eval_blocks(quick=True, device=torch.device("cpu"))
    assert out["blocks_per_s"] > 0


def test_gpu_suites_are_registered_and_skip_on_cpu():
    """`python -m bench` runs the GPU suites of bench/gpu/steps.py wherever it runs: on CPU they say why not."""
    for name in ("gpu_train_step", "gpu_extraction_kernels"):
        assert suites.SUITES[name](quick=True, device=torch.device("cpu")) == {"skipped": "needs CUDA"}


def test_the_dflash2_bench_times_the_coupled_step_beside_the_detached_one():
    """bench --only dflash2 reports the coupled selector step over the detached one, from the same run, in the
    shape's figures and the headline (a tiny shape here: the figures, not their values)."""
    from bench import dflash2

    shape = {"hidden": 32, "vocab": 64, "heads": 1, "head_dim": 32, "layers": 1, "block": 4, "anchors": 8, "rank": 4,
             "top_k": 8}
    out = dflash2.shape_costs("tiny", shape, quick=True, device=torch.device("cpu"))
    assert set(out["train_step_s"]) == {"dflash", "dflash2", "dflash2_coupled"}
    times = out["train_step_s"]  # rounded to 10 us: the ratio of the unrounded medians within 1%
    assert out["coupled_over_detached"] == pytest.approx(times["dflash2_coupled"] / times["dflash2"], rel=0.01)
    assert suites.headline({"dflash2": {"shapes": {"tiny": out}}})["dflash2_coupled_step_over_detached"] == \
        out["coupled_over_detached"]


def test_paired_times_keep_the_ratio_when_the_machine_drifts(monkeypatch):
    """bench.measure.paired_times: the step and the matmul yardstick called in turn (scripted clock). The machine's
    speed drifts 3x over the five pairs, and in the last two it slowed between the step and its matmul. The median of
    the pairs' ratios is 0.2, as three of five pairs say; the ratio of the two medians would read 0.4."""
    from bench import measure

    steps, matmuls = [1.0, 3.0, 1.5, 2.0, 1.0], [0.2, 0.6, 0.3, 0.9, 0.7]
    times = iter([t for pair in zip(steps, matmuls) for t in pair])  # the warm-up pair is not timed
    calls = []
    monkeypatch.setattr(measure, "time_call", lambda fn: (fn(), next(times))[1])
    step, mm, ratio = measure.paired_times(lambda: calls.append("step"), lambda: calls.append("mm"), repeat=5)
    assert calls == ["step", "mm"] * 6
    assert (step, mm) == (1.5, 0.6)  # their ratio, 0.4, is what medians taken apart give
    assert abs(ratio - 0.2) < 1e-12


def test_a_second_run_of_the_day_goes_beside_the_first(tmp_path, monkeypatch):
    """python -m bench used to write bench/results/<date>-<machine>.json over a result of the same day (a
    committed one included); the second run now goes to <...>-2.json and the first stays as it was."""
    from bench import run

    monkeypatch.setattr(run, "RESULTS", tmp_path)
    monkeypatch.setattr(run, "matmul_flops", lambda device: 1e9)  # the yardstick's figure is not under test
    first = run.main(["--quick", "--only", "bytes_per_token"])
    written = sorted(tmp_path.glob("*.json"))
    assert len(written) == 1
    before = written[0].read_text()
    run.main(["--quick", "--only", "bytes_per_token"])
    assert {p.name for p in tmp_path.glob("*.json")} == {written[0].name, written[0].name.replace(".json", "-2.json")}
    assert written[0].read_text() == before and first["benchmarks"]["bytes_per_token"]


def test_the_head_loss_bench_times_the_fused_ce_beside_the_recompute_on_the_same_numbers():
    """bench --only head_loss: the fused chunked CE and the recomputed chunks side by side, the same loss and
    gradient (quick sizes: the figures, not their values)."""
    from bench import head_loss

    out = head_loss.head_loss_costs(quick=True, device=torch.device("cpu"))
    for kind in ("dflash", "dflash2"):
        assert out[kind]["loss_rel_diff"] < 1e-6 and out[kind]["grad_rel_diff"] < 1e-4, out[kind]
    assert out["chunk_logits"] < out["shape"]["rows"] * out["shape"]["vocab"]  # chunked: the two paths differ
    assert suites.headline({"head_loss": out})["head_loss_recompute_over_fused"] == out["recompute_over_fused"] > 0


def test_the_checkpointing_bench_times_the_three_modes_on_the_same_step():
    """bench --only checkpointing: no, selective and full gradient checkpointing on one step, the same loss, each
    peak below the last (quick sizes: the figures, not their values)."""
    from bench import checkpointing

    out = checkpointing.checkpointing_costs(quick=True, device=torch.device("cpu"))
    assert out["same_loss"] and set(out["step_s"]) == {"off", "selective", "full"}
    assert out["peak_mib"]["off"] > out["peak_mib"]["selective"] > out["peak_mib"]["full"]
    assert suites.headline({"checkpointing": out})["checkpointing_selective_step_over_full"] == out[
        "selective_step_over_full"] > 0
