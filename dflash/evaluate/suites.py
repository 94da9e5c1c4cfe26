"""Benchmark suites: named benchmarks read from local files, each a held-out set of its own.

`eval.suite=paper` evaluates the DFlash paper's benchmarks (arXiv 2602.06036: GSM8K, MATH-500,
AIME24, AIME25, HumanEval, MBPP, LiveCodeBench, MT-Bench, Alpaca); `math`, `code` and `chat` are
its three groups; `coding` is the ten shipped coding tasks (builtin:eval_coding). Nothing is
downloaded at run time: each benchmark is a file (or a `datasets.save_to_disk` folder) under
eval.benchmarks_dir, in the format its publisher ships (jsonl, parquet or a datasets folder), and a
missing one is an error naming the file and the dataset to fetch it from.

Prompt formatting follows the paper's own evaluation code (github.com/z-lab/dflash, model/utils.py
`load_and_process_dataset` and run_benchmark.sh as of commit 0582f12, March 2026; dflash/benchmark.py
`DATASETS` today): greedy decoding (temperature 0; eval.temperature, top_p, top_k and verifier pass through to
every benchmark, and the README's temperature-1 rows are in conf/references/), at most 2048 new tokens (run_benchmark.sh
`--max-new-tokens 2048`; the paper states the same budget, z-lab/dflash issue #21), thinking off
unless `--enable-thinking` (our data.enable_thinking, false by default), the chat template applied
to a single user turn, and per benchmark:
- GSM8K, MATH-500, AIME24, AIME25: the problem, a newline, then "Please reason step by step, and put
  your final answer within \\boxed{}." (the Qwen math instruction).
- HumanEval: "Write a solution to the following problem and make sure that it passes the tests:"
  and the prompt in a python code fence.
- MBPP (sanitized): the `prompt` field as it is.
- LiveCodeBench (code_generation_lite): the LiveCodeBench generation prompt: the expert-programmer
  instruction, "### Question:", the starter code (or a placeholder) under "### Format:", then
  "### Answer: (use the provided format with backticks)".
- MT-Bench: the first turn only. The paper's script continues with the second turn on its own
  answer; a held-out set here is one prompt and its greedy completion, so only turn one is scored.
- Alpaca: the instruction, plus "\\n\\nInput:\\n" and the input when there is one.
Sample counts are the script's (128 per benchmark, 30 for each AIME, all 164 HumanEval, all 80
MT-Bench); the script samples them at random, we take the first ones (eval.max_prompts lowers it).

Each benchmark's formatted prompts are written once to a jsonl named after it (under
features.dir/benchmarks/<content hash>/), which becomes that benchmark's eval.prompts: the held-out
set (dflash.evaluate.heldout) is then cached per benchmark and keyed by its prompts' content.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from dflash.config import JobConfig
from dflash.data.prompts import read_records
from dflash.errors import ConfigError, DataError, NotFoundError

REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."
LCB_SYSTEM = ("You are an expert Python programmer. You will be given a question (problem specification) and will "
              "generate a correct Python program that matches the specification and passes all tests. You will NOT "
              "return anything except for the program")
ID_FIELDS = ("id", "task_id", "question_id", "prompt_id", "unique_id", "problem_idx")


def _math(field: str) -> Callable[[dict], str]:
    return lambda r: _text(r, field) + REASON


def _humaneval(r: dict) -> str:
    return ("Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
            f"{_text(r, 'prompt')}\n```")


def _livecodebench(r: dict) -> str:
    starter = r.get("starter_code") or ""
    fmt = ("### Format: Use the following code structure:\n```python\n" + starter + "\n```" if starter else
           "### Format: Write your code in the following format:\n```python\n# YOUR CODE HERE\n```")
    return (f"{LCB_SYSTEM}\n\n### Question:\n{_text(r, 'question_content')}\n\n{fmt}\n\n"
            "### Answer: (use the provided format with backticks)")


def _mt_bench(r: dict) -> str:
    turns = r.get("prompt", r.get("turns"))
    if isinstance(turns, str):
        return turns
    if not turns or not isinstance(turns[0], str):
        raise DataError(f"an MT-Bench record holds no turns under 'prompt' or 'turns' (keys: {sorted(r)})")
    return turns[0]


def _alpaca(r: dict) -> str:
    extra = r.get("input") or ""
    return _text(r, "instruction") + (f"\n\nInput:\n{extra}" if extra else "")


def _text(r: dict, field: str) -> str:
    value = r.get(field)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"a record holds no {field!r} text (keys: {sorted(r)})")
    return value


@dataclass(frozen=True)
class Benchmark:
    name: str
    """Key in metrics (eval/<name>/tau) and the stem of the files looked for."""
    format: Callable[[dict], str] | None
    """Record -> the user turn (None: the records are prompts already, e.g. a builtin: set)."""
    published: str
    """Where the data is published (the dataset to download, e.g. with datasets.load_dataset + save_to_disk)."""
    samples: int | None = None
    """Prompts the paper's script evaluates (the first this many are taken)."""
    split: str = "test"
    """Split of a datasets folder holding a DatasetDict."""
    builtin: str | None = None
    """A shipped prompt set instead of a file under eval.benchmarks_dir."""


BENCHMARKS = {b.name: b for b in [
    Benchmark("gsm8k", _math("question"), "openai/gsm8k (config main, split test)", 128),
    Benchmark("math500", _math("problem"), "HuggingFaceH4/MATH-500 (split test)", 128),
    Benchmark("aime24", _math("problem"), "HuggingFaceH4/aime_2024 (split train)", 30, split="train"),
    Benchmark("aime25", _math("problem"), "MathArena/aime_2025 (split train)", 30, split="train"),
    Benchmark("humaneval", _humaneval, "openai/openai_humaneval (split test)", 164),
    Benchmark("mbpp", lambda r: _text(r, "prompt"), "google-research-datasets/mbpp (config sanitized, split test)", 128),
    Benchmark("livecodebench", _livecodebench, "livecodebench/code_generation_lite (test.jsonl ... test6.jsonl)", 128),
    Benchmark("mt_bench", _mt_bench, "HuggingFaceH4/mt_bench_prompts (split train)", 80, split="train"),
    Benchmark("alpaca", _alpaca, "tatsu-lab/alpaca (split train)", 128, split="train"),
    Benchmark("coding", None, "shipped with dflash (dflash/assets/prompts/eval_coding.jsonl)", builtin="builtin:eval_coding"),
]}
SUITES = {
    "paper": ["gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "mt_bench", "alpaca"],
    "math": ["gsm8k", "math500", "aime24", "aime25"],
    "code": ["humaneval", "mbpp", "livecodebench"],
    "chat": ["mt_bench", "alpaca"],
    "coding": ["coding"],
}


def suite_names(suite: str) -> list[str]:
    """The benchmarks of a suite: a name in SUITES, or benchmark names joined by '+' (gsm8k+humaneval)."""
    names = SUITES.get(suite, suite.split("+"))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"eval.suite={suite}: unknown benchmark(s) {', '.join(unknown)}; suites: "
                          f"{', '.join(SUITES)}; benchmarks (join with +): {', '.join(BENCHMARKS)}")
    return names


def find_file(bench: Benchmark, root: Path) -> tuple[Path, str]:
    """(path, reader format) of a benchmark under `root`: <name>.jsonl, <name>.parquet, or a folder <name>/
    holding a datasets.save_to_disk copy (dataset_info.json / dataset_dict.json) or jsonl/parquet files."""
    for path, fmt in ((root / f"{bench.name}.jsonl", "jsonl"), (root / f"{bench.name}.parquet", "parquet")):
        if path.is_file():
            return path, fmt
    folder = root / bench.name
    if (folder / "dataset_info.json").exists() or (folder / "dataset_dict.json").exists():
        return folder, "hf"
    if folder.is_dir() and any(p.suffix in (".jsonl", ".parquet") for p in folder.iterdir()):
        return folder, "auto"
    raise NotFoundError(
        f"benchmark {bench.name}: none of {root}/{bench.name}.jsonl, {root}/{bench.name}.parquet or a datasets folder "
        f"{root}/{bench.name}/ exists (eval.benchmarks_dir={root}). It is published as {bench.published}: download it "
        f"on a machine with network access (e.g. datasets.load_dataset(...).save_to_disk('{folder}')) and copy it here")


def benchmark_prompts(job: JobConfig, name: str) -> str:
    """The prompts source (for eval.prompts) of one benchmark: its formatted prompts as a jsonl."""
    bench = BENCHMARKS[name]
    if bench.builtin is not None:
        return bench.builtin
    if job.eval.benchmarks_dir is None:
        raise ConfigError(f"eval.suite={job.eval.suite} reads benchmark files: set eval.benchmarks_dir to the folder "
                          f"holding them (e.g. {name}.jsonl; {name} is published as {bench.published})")
    path, fmt = find_file(bench, Path(job.eval.benchmarks_dir).expanduser())
    records = read_records(str(path), fmt="hf" if fmt == "hf" else "auto", split=bench.split)[: bench.samples]
    if not records:
        raise DataError(f"benchmark {name}: {path} holds no records")
    rows, seen = [], set()
    for n, r in enumerate(records):
        try:
            text = bench.format(r)
        except DataError as e:
            raise DataError(f"benchmark {name}: {path} record {n}: {e}") from None
        rid = next((str(r[k]) for k in ID_FIELDS if r.get(k) not in (None, "")), str(n))
        rid = rid if rid not in seen else f"{rid}#{n}"
        seen.add(rid)
        rows.append({"id": rid, "prompt": text})
    body = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    digest = hashlib.sha256(body.encode()).hexdigest()[:12]
    out = Path(job.features.dir) / "benchmarks" / digest / f"{name}.jsonl"
    if not out.exists():  # written once per content; every process writes the same bytes, renamed atomically
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        tmp.write_text(body)
        os.replace(tmp, out)
    return str(out)


def benchmark_jobs(job: JobConfig) -> dict[str | None, JobConfig]:
    """{benchmark: the job with that benchmark's prompts as eval.prompts}; {None: job} without eval.suite."""
    if job.eval.suite is None:
        return {None: job}
    return {name: replace(job, eval=replace(job.eval, prompts=benchmark_prompts(job, name)))
            for name in suite_names(job.eval.suite)}


def live_per_prompt(records: list[dict]) -> dict[str, dict]:
    """Per-prompt table of live decoding (the single-path steps): mean tau and steps ("blocks") per prompt."""
    table: dict[str, list[int]] = {}
    for r in records:
        if r.get("tree_budget") is None:
            table.setdefault(r["prompt_id"], []).append(r["tau"])
    return {pid: {"tau": sum(t) / len(t), "blocks": len(t)} for pid, t in table.items()}


MEAN_KEYS = ("tau", "tau_macro", "full", "tau_all_anchors", "full_all_anchors", "live_tau",
             "live_tokens_per_forward", "live_tokens_per_verify", "live_verify_cost", "live_speedup")


def combine(suite: str, summaries: dict[str, dict]) -> dict:
    """One drafter's suite result from its per-benchmark summaries: eval/<bench>/<metric> for every metric,
    eval/mean/<metric> the paper-style mean over benchmarks (each benchmark weighs the same, whatever its
    size) of the headline metrics (tau, full, tau_all_anchors, acc@k, ddtree@N, live tau and tokens per
    forward), the per-prompt rows of every benchmark (`prompts`, best first) and the summed tau histogram."""
    metrics, prompts = {}, []
    for bench, s in summaries.items():
        metrics.update({f"eval/{bench}/{k.removeprefix('eval/')}": v for k, v in s["metrics"].items()})
        table = s.get("per_prompt") or {}
        prompts += [{"benchmark": bench, "prompt_id": pid, "tau": row["tau"], "blocks": row["blocks"],
                     **({"tau_all_anchors": row["tau_all_anchors"]} if "tau_all_anchors" in row else {})}
                    for pid, row in table.items() if "tau" in row]
    first = next(iter(summaries.values()))
    keys = [k for k in first["metrics"] if k.removeprefix("eval/") in MEAN_KEYS or k.startswith(("eval/acc@", "eval/ddtree@"))
            and "live" not in k]
    for k in keys + [k for k in first["metrics"] if k.startswith("eval/live_ddtree@")
                     and k.endswith(("_tau", "_tokens_per_forward", "_verify_cost"))]:
        values = [s["metrics"][k] for s in summaries.values() if k in s["metrics"]]
        metrics[f"eval/mean/{k.removeprefix('eval/')}"] = sum(values) / len(values)
    metrics["eval/mean/benchmarks"] = len(summaries)
    hists = [s["tau_histogram"] for s in summaries.values()]
    hist = [sum(h[i] for h in hists if i < len(h)) for i in range(max(map(len, hists)))]
    prompts.sort(key=lambda p: (-p["tau"], p["benchmark"], p["prompt_id"]))
    return {"suite": suite, "benchmarks": list(summaries), "metrics": metrics, "prompts": prompts,
            "tau_histogram": hist, "block_size": first["block_size"], "ddtree_budgets": first["ddtree_budgets"],
            "mode": first.get("mode", "teacher_forced")}


def mean_metrics(suite_summary: dict) -> dict:
    """The suite mean as plain eval/<metric> keys (what print_gap and train_gap read)."""
    prefix = "eval/mean/"
    return {"eval/" + k.removeprefix(prefix): v for k, v in suite_summary["metrics"].items() if k.startswith(prefix)}


REFERENCES = Path(__file__).resolve().parents[2] / "conf" / "references"


def load_references(spec: str | None) -> list[dict]:
    """Published figures to show beside ours: eval.references, a YAML file or the name of one shipped in
    conf/references/. Each entry: name, source (paper table or model card), target, thinking, block_size,
    temperature (with top_p, top_k and verifier when sampled), and `tau` per benchmark name ({gsm8k: 6.5, ...});
    settings not given are not compared."""
    if spec is None:
        return []
    path = Path(spec).expanduser()
    if not path.is_file() and "/" not in spec and not spec.endswith((".yaml", ".yml")):
        path = REFERENCES / f"{spec}.yaml"
    if not path.is_file():
        shipped = sorted(p.stem for p in REFERENCES.glob("*.yaml"))
        raise NotFoundError(f"eval.references={spec}: no such file; give a YAML path or one of {', '.join(shipped)}")
    import yaml

    data = yaml.safe_load(path.read_text()) or {}
    refs = data.get("references") or []
    for n, ref in enumerate(refs):
        if not isinstance(ref, dict) or "name" not in ref or "source" not in ref:
            raise DataError(f"{path}: references[{n}] needs a name and a source (paper table or model card)")
        unknown = sorted(set(ref.get("tau") or {}) - set(BENCHMARKS))
        if unknown:
            raise DataError(f"{path}: references[{n}] ({ref['name']}) has tau for unknown benchmark(s) "
                            f"{', '.join(unknown)}; benchmarks: {', '.join(BENCHMARKS)}")
    return refs


def setting_differences(ref: dict, job: JobConfig, block_size: int) -> list[str]:
    """The settings where a reference was measured differently from this evaluation (target, thinking,
    block size, temperature, and at temperature > 0 top-p, top-k and the verifier: rejection, seeded or a
    reference's exact_match of greedy drafts), each as 'what: theirs (ours ...)'; settings the reference leaves
    out are not compared."""
    out = []
    target = ref.get("target")
    ours = {job.target.name.lower(), job.target.path.lower(), Path(job.target.path).name.lower()}
    if target is not None and str(target).lower() not in ours and Path(str(target)).name.lower() not in ours:
        out.append(f"target {target} (ours {job.target.path})")
    if ref.get("thinking") is not None and bool(ref["thinking"]) != job.data.enable_thinking:
        out.append(f"thinking {'on' if ref['thinking'] else 'off'} (ours {'on' if job.data.enable_thinking else 'off'})")
    if ref.get("block_size") is not None and int(ref["block_size"]) != block_size:
        out.append(f"block size {ref['block_size']} (ours {block_size})")
    if ref.get("temperature") is not None and float(ref["temperature"]) != job.eval.temperature:
        out.append(f"temperature {ref['temperature']} (ours {job.eval.temperature})")
    if job.eval.temperature > 0 and float(ref.get("temperature") or 0) > 0:
        if ref.get("top_p") is not None and float(ref["top_p"]) != job.eval.top_p:
            out.append(f"top-p {ref['top_p']} (ours {job.eval.top_p})")
        if ref.get("top_k") is not None and int(ref["top_k"]) != job.eval.top_k:
            out.append(f"top-k {ref['top_k']} (ours {job.eval.top_k})")
        if ref.get("verifier") is not None and ref["verifier"] != job.eval.verifier:
            out.append(f"verifier {ref['verifier']} (ours {job.eval.verifier})")
    return out
