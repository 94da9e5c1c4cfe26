"""Benchmark suites: files in each public format, the paper's prompt formatting, clear errors, references."""

import json

import pytest

from dflash.errors import ConfigError, DataError, NotFoundError
from dflash.evaluate import suites
from tests.conftest import compose


def job(tmp, *overrides):
    return compose("evaluate", ["debug=tiny", f"features.dir={tmp}/cache", f"eval.benchmarks_dir={tmp}/bench",
                                *overrides])


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
    j = job(tmp_path, "eval.suite=gsm8k+humaneval+mt_bench")
    benches = suites.benchmark_jobs(j)
    assert list(benches) == ["gsm8k", "humaneval", "mt_bench"]
    gsm8k, humaneval, mt_bench = (read(b.eval.prompts) for b in benches.values())
    assert gsm8k[0] == {"id": "0", "prompt": "What is 2 + 3?\nPlease reason step by step, and put your final "
                                             "answer within \\boxed{}."}
    assert humaneval[1]["id"] == "HumanEval/1" and humaneval[1]["prompt"] == (
        "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
        "def neg(a):\n    \"\"\"Negate.\"\"\"\n\n```")
    assert mt_bench == [{"id": "81", "prompt": "Write a haiku about rain."}, {"id": "82", "prompt": "Describe a cat."}]
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
        suites.benchmark_jobs(job(tmp_path, "eval.suite=math"))
    with pytest.raises(ConfigError, match="set eval.benchmarks_dir"):
        suites.benchmark_jobs(job(tmp_path, "eval.suite=gsm8k", "eval.benchmarks_dir=null"))
    with pytest.raises(ConfigError, match=r"unknown benchmark\(s\) gsm9k.*paper"):
        suites.benchmark_jobs(job(tmp_path, "eval.suite=gsm9k"))
    (tmp_path / "bench" / "gsm8k.jsonl").write_text(json.dumps({"problem": "wrong field"}) + "\n")
    with pytest.raises(DataError, match=r"benchmark gsm8k: .*record 0: .*no 'question' text"):
        suites.benchmark_jobs(job(tmp_path, "eval.suite=gsm8k"))


def test_coding_is_a_suite_of_its_own_and_paper_counts_are_kept(tmp_path):
    assert suites.benchmark_jobs(job(tmp_path, "eval.suite=coding"))["coding"].eval.prompts == "builtin:eval_coding"
    root = tmp_path / "bench"
    root.mkdir()
    (root / "aime24.jsonl").write_text("".join(json.dumps({"id": n, "problem": f"p{n}"}) + "\n" for n in range(40)))
    assert len(read(suites.benchmark_prompts(job(tmp_path), "aime24"))) == 30  # the paper's script: 30 per AIME


def test_heldout_sets_are_keyed_per_benchmark_by_content(tmp_path, tiny_targets):
    from dflash.evaluate.heldout import heldout_paths

    target = tiny_targets["tiny_qwen3"]
    write_benchmarks(tmp_path / "bench")
    benches = suites.benchmark_jobs(job(tmp_path, "eval.suite=gsm8k+humaneval"))
    paths = {name: heldout_paths(b, target, [1, 3])[0] for name, b in benches.items()}
    assert paths["gsm8k"] != paths["humaneval"] and "eval-gsm8k-" in str(paths["gsm8k"])
    write_benchmarks(tmp_path / "bench", gsm8k_question="What is 2 + 4?")  # the same file name, other prompts
    edited = suites.benchmark_jobs(job(tmp_path, "eval.suite=gsm8k+humaneval"))
    assert heldout_paths(edited["gsm8k"], target, [1, 3])[0] != paths["gsm8k"]
    assert heldout_paths(edited["humaneval"], target, [1, 3])[0] == paths["humaneval"]


def test_the_suite_mean_weighs_each_benchmark_the_same():
    def summary(taus, n):
        return {"metrics": {"eval/tau": taus, "eval/acc@1": 0.5, "eval/blocks": n, "eval/prompts": 1},
                "per_prompt": {f"p{n}": {"tau": taus, "blocks": n}}, "tau_histogram": [n, 0],
                "block_size": 2, "ddtree_budgets": []}
    s = suites.combine("paper", {"a": summary(2.0, 100), "b": summary(4.0, 1)})
    assert s["metrics"]["eval/mean/tau"] == 3.0 and s["metrics"]["eval/a/blocks"] == 100
    assert "eval/mean/blocks" not in s["metrics"] and s["metrics"]["eval/mean/benchmarks"] == 2
    assert [p["benchmark"] for p in s["prompts"]] == ["b", "a"] and s["tau_histogram"] == [101, 0]
    assert suites.mean_metrics(s)["eval/tau"] == 3.0


def test_references_load_and_mark_settings_that_differ(tmp_path):
    shipped = suites.load_references("dflash_paper")
    assert {r["name"] for r in shipped} >= {"z-lab Qwen3-8B-DFlash-b16", "z-lab Qwen3-4B-DFlash-b16"}
    assert all(r["source"] and len(r["tau"]) == 9 and r["temperature"] in (0, 1) for r in shipped)
    assert next(r for r in shipped if "8B" in r["name"])["tau"]["gsm8k"] == 6.55  # the README's table, as read
    hot = next(r for r in shipped if "8B" in r["name"] and r["temperature"] == 1)
    assert hot["tau"]["gsm8k"] == 6.04 and hot["verifier"] == "exact_match"  # its temperature-1 row
    path = tmp_path / "refs.yaml"
    path.write_text("references:\n  - {name: ref, source: model card, target: Qwen/Qwen3-8B, thinking: false, "
                    "block_size: 16, tau: {gsm8k: 6.0}}\n")
    [ref] = suites.load_references(str(path))
    j = compose("evaluate", ["debug=tiny"])
    assert suites.setting_differences(ref, j, 16) == ["target Qwen/Qwen3-8B (ours " + j.target.path + ")"]
    differs = suites.setting_differences({**ref, "target": j.target.name, "thinking": True, "temperature": 1.0}, j, 8)
    assert differs == ["thinking on (ours off)", "block size 16 (ours 8)", "temperature 1.0 (ours 0.0)"]
    sampled = compose("evaluate", ["debug=tiny", "eval.temperature=1.0", "eval.top_p=0.9"])
    assert suites.setting_differences({**hot, "target": j.target.name}, sampled, 16) == [
        "top-p 1.0 (ours 0.9)", "verifier exact_match (ours rejection)"]  # a sampled reference: how it sampled
    path.write_text("references:\n  - {name: ref, source: x, tau: {gsm9k: 1.0}}\n")
    with pytest.raises(DataError, match="unknown benchmark"):
        suites.load_references(str(path))
    with pytest.raises(NotFoundError, match="dflash_paper"):
        suites.load_references("nope")


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
    assert paper.eval.max_new_tokens == 2048 and paper.eval.temperature == 0.0 and not paper.data.enable_thinking
    assert paper.eval.references == "dflash_paper"
