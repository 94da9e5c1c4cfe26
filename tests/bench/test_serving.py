"""bench/serving.py, the concurrency sweep in vLLM: its parts that run without vLLM (the sweep itself is
`make serving`, run by .ci/run beside `make engines`)."""

import json
import sys
from collections import Counter

import pytest

from bench import serving
from bench.engines.server import EngineError


def test_every_run_holds_every_prompt_equally_often(tmp_path):
    path, prompts, sizes = serving.write_prompts(tmp_path, [1, 8, 64, 128])
    assert len(prompts) == 16 and sizes == [16, 16, 64, 128]
    lines = [json.loads(line)["prompt"] for line in path.read_text().splitlines()]
    for n in sizes:  # vllm bench serve --disable-shuffle takes the first n lines
        assert set(Counter(lines[:n]).values()) == {n // 16}


def test_a_drafter_the_engine_refuses_is_one_line_and_no_load_runs(tmp_path):
    refuse = [sys.executable, "-c", "print('ValueError: dflash drafts need Triton on this build'); raise SystemExit(1)",
              "--port", "{port}"]
    with pytest.raises(EngineError, match="exited with code 1: ValueError: dflash drafts need Triton"):
        serving.drive(sys.executable, {"drafter": refuse}, [("drafter", ["--never-run"])], tmp_path, timeout=30)
    assert not (tmp_path / "load.json").exists()


def test_both_servers_are_up_at_once_and_each_run_goes_to_its_own(tmp_path):
    # two stand-in servers (a folder with a "health" file, served over HTTP) and a stand-in client that answers each
    # run with the URL it was given: the runs alternate plain / drafter, each against its own server
    (tmp_path / "health").write_text("ok")
    server = [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    client = tmp_path / "client"
    client.write_text(f"#!{sys.executable}\nimport json, sys\nruns = json.load(open(sys.argv[2]))['runs']\n"
                      f"json.dump({{'results': [{{'url': r[0]}} for r in runs]}}, open(sys.argv[3], 'w'))\n")
    client.chmod(0o755)
    runs = [(name, ["{url}", str(i)]) for i in range(2) for name in ("plain", "drafter")]
    done = serving.drive(str(client), {"plain": server, "drafter": server}, runs, tmp_path, timeout=60)
    urls = [r["url"] for r in done]
    assert urls[0] == urls[2] != urls[1] == urls[3] and all(u.startswith("http://127.0.0.1:") for u in urls)


def load_result(tok_s, ttft_ms=10.0, tpot_ms=5.0, accepted=None):
    return {"output_throughput": tok_s, "mean_ttft_ms": ttft_ms, "mean_tpot_ms": tpot_ms, "total_output_tokens": 480,
            "completed": 10, "spec_decode_acceptance_length": accepted}


def test_each_server_counts_by_its_fastest_round_and_the_model_by_that_plain_run():
    # a stalled plain round (its tokens/s halved, its ttft 50x) must neither make the ratio nor feed the baseline
    steps = {"seconds": {kind: {"1": 1e-3} for kind in ("target_decode", "target_verify", "drafter")},
             "step": {"0": {"1": 6e-3}}, "admission": {"1": 0.0}}
    clean = {"step": {"0": {"1": 4e-3}}, "admission": {"1": 0.0}}
    rounds = [(load_result(200.0), load_result(300.0, accepted=3.0)),
              (load_result(100.0, ttft_ms=500.0), load_result(280.0, accepted=3.0))]
    table = serving.temperature_table("0", {1: rounds}, {"tau": 3.0}, clean, steps)
    row = table["rows"][0]
    assert row["ratio"] == pytest.approx(1.5) and row["round_ratios"] == pytest.approx([1.5, 2.8])
    assert row["plain_ttft_ms"] == 10.0 and row["vllm_acceptance_length"] == 3.0
    # served: 5 ms a token served less 4 ms clean; a speculative step 6 + 3 x 1 ms for 3 tokens
    assert row["served_ms_per_token"] == pytest.approx(1.0)
    assert row["predicted_ratio"] == pytest.approx((10e-3 + 47 * 5e-3) / (10e-3 + 1e-3 + 47 / 3 * 9e-3))


def test_no_vllm_venv_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="not there; `make engines` builds the vLLM venv"):
        serving.main(["--vllm-python", str(tmp_path / "nope" / "python")])


def result(ratios, predicted):
    rows = [{"concurrency": c, "requests": 16, "plain_tok_s": 100.0 * c, "drafter_tok_s": 100.0 * c * r, "ratio": r,
             "round_ratios": [r, 0.9 * r], "vllm_acceptance_length": 3.0, "predicted_ratio": p, "error": p / r - 1}
            for c, r, p in zip((1, 2, 4), ratios, predicted)]
    return {"target": "/t/tiny_qwen3_hd32", "drafter_from": "given", "num_speculative_tokens": 7, "output_len": 48,
            "engine": {"vllm": "0.32.0+cpu"}, "machine": {"cores": 2},
            "temperatures": {"0": {"our_acceptance": {"tau": 3.0}, "rows": rows, "crossing": 4,
                                   "predicted_crossing": None, "max_abs_error": max(abs(r["error"]) for r in rows)}},
            "model_within_tolerance": False}


def test_the_verdict_and_the_plot_say_what_was_measured_and_predicted(tmp_path):
    r = result([1.8, 1.3, 0.9], [1.7, 1.2, 1.1])
    text = serving.verdict(r)
    assert "crosses 1 at 4 (model: none)" in text and "+22%" in text and "every concurrency: NO" in text
    serving.plot(r, tmp_path / "sweep.png")
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_a_vllm_venv_without_pandas_is_one_line_before_anything_starts(tmp_path):
    # vllm bench serve's custom dataset needs pandas; without it the client died deep in vLLM naming "vllm"
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\nexit 1\n")
    python.chmod(0o755)
    with pytest.raises(SystemExit, match="has no pandas"):
        serving.main(["--vllm-python", str(python)])
