"""How a run trains, evaluates, logs and guards provenance."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash.config.checks import ConfigError, enum_value, one_of, positive

CHECKPOINTING_MODES = ("off", "selective", "full", "auto")
"""train.gradient_checkpointing's values; dflash.drafter.recompute applies the first three."""
COMPILE_MODES = ("off", "layers", "model")
"""train.compile's values."""
SERVING_GPUS = ("h200", "h100", "a100")
"""The GPUs the serving model knows (eval.serving.gpu, the plan's gpu=): dflash.plan.serving.GPUS holds their
figures, keyed by these names."""


@dataclass
class OptimConfig:
    """AdamW (or Muon + AdamW) with warmup and a cosine (or constant) schedule."""

    name: str = "adamw"
    """adamw, or muon: torch.optim.Muon for the drafter's hidden 2-D weights, AdamW for the rest
    (dflash.train.optim.build_optimizer says which is which)."""
    lr: float = 6e-4
    """Peak learning rate (of AdamW's parameters)."""
    muon_lr: float = 0.02
    """Peak learning rate of Muon's parameters (optim=muon), scaled per matrix by torch's adjust_lr_fn."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov)."""
    muon_adjust_lr: str = "original"
    """torch.optim.Muon adjust_lr_fn: original (lr * sqrt(max(1, rows/cols))) or match_rms_adamw
    (0.2 * sqrt(max(rows, cols)) * lr, so an AdamW-sized lr fits)."""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    fused: str = "auto"
    """AdamW's fused kernel (one kernel over every tensor, no foreach temporary the size of the parameters at the
    step's peak): auto (on CUDA; elsewhere the default foreach/for-loop, so CPU runs keep their numbers), true, false."""
    schedule: str = "cosine"
    """cosine or constant (after warmup)."""
    warmup_ratio: float = 0.04
    """Fraction of all steps spent warming up linearly from 0."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr` (cosine)."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""

    def __post_init__(self) -> None:
        positive("optim.lr", self.lr)
        one_of("optim.name", self.name, {"adamw", "muon"})
        positive("optim.muon_lr", self.muon_lr)
        one_of("optim.muon_adjust_lr", self.muon_adjust_lr, {"original", "match_rms_adamw"})
        one_of("optim.schedule", self.schedule, {"cosine", "constant"})
        one_of("optim.fused", str(self.fused).lower(), {"auto", "true", "false"})
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"optim.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if len(self.betas) != 2:
            raise ConfigError(f"optim.betas={self.betas} needs two values")
        positive("optim.grad_clip", self.grad_clip, allow_zero=True)


@dataclass
class TrainConfig:
    """The training loop."""

    mode: str = "offline"
    """offline (read the feature cache; extracted first if missing) or online (target in-process)."""
    epochs: int = 6
    """Passes over the training sequences (anchors are resampled each epoch)."""
    max_steps: int | None = None
    """Stop after this many optimizer steps (overrides epochs for the schedule)."""
    batch_size: int = 1
    """Sequences per process per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step."""
    num_anchors: int = 512
    """Blocks (anchors) sampled per sequence."""
    log_every: int = 10
    """Log train/* metrics every this many steps."""
    save_every: int = 1000
    """Write a checkpoint every this many steps (and always at the end)."""
    keep_last: int = 3
    """Keep the newest this many step checkpoints (plus `best`)."""
    resume: str | None = None
    """latest, best, stepN / stepNk, or a checkpoint path: restore everything and continue."""
    seed: int = 0
    """Seed of initialisation, anchor sampling and noise."""
    mixed_precision: str = "auto"
    """auto (bf16 on CUDA, none on CPU), no or bf16."""
    attention: str = "auto"
    """Packed-block attention: auto (flex on CUDA, sdpa on CPU), flex or sdpa."""
    compile: str = "off"
    """torch.compile the drafter in training: off; model (the whole drafter as one graph); or layers (training's call
    of a decoder layer, fullgraph, its checkpointing and flex attention inside: one graph per padded shape that the
    layers share, under flex one per kind of layer; dflash.drafter.recompute.compile_layers). false and true, its
    old spellings, are read as off and model, with a deprecation note."""
    conv_kernel: str = "auto"
    """DFlash 2's grouped dynamic convolution in training: torch (the path exports run), triton (two fused kernels,
    dflash/drafter/conv_kernel.py: CUDA with triton installed, a power-of-two conv_group_size), or auto (triton
    where it can run and train.compile is off, else torch). The run logs the choice and records it in run.json;
    DFlash drafters have no convolution."""
    distributed: str = "ddp"
    """ddp, or fsdp (CUDA only: FSDP2, each drafter layer sharded) for drafters too large to replicate."""
    gradient_checkpointing: str = "auto"
    """Recompute drafter layer activations in backward to save memory: off; selective (keep each layer's matmul and
    attention outputs, recompute its norms, rotary and activations: 38% of what a layer keeps with off at the
    recipes' shapes, no matmul recomputed); full (keep only each layer's input, recompute everything: a third more
    FLOPs); or auto (on a CUDA device the first of off, selective, full whose step the memory plan says fits the
    device, with its margin; off on CPU), resolved once as training starts (dflash.train.fit.resolve_checkpointing)
    and recorded in run.json. false and true, its old spellings, are read as off and full, with a deprecation
    note. `python -m dflash.plan` shows auto's choice per GPU size."""
    num_workers: int = 1
    """DataLoader worker processes."""
    save_dtype: str = "bfloat16"
    """dtype of a checkpoint's servable model.safetensors (bfloat16, as published drafters ship, or float32);
    train_state/ always keeps the float32 weights, so resuming is exact either way."""
    collective_timeout_minutes: float = 30.0
    """How long a collective (and a short barrier) waits for every process before the run aborts; waits after
    per-process work of any length (completions, extraction, in-run evaluation) do not depend on it."""

    def __post_init__(self) -> None:
        one_of("train.mode", self.mode, {"offline", "online"})
        one_of("train.mixed_precision", self.mixed_precision, {"auto", "no", "bf16"})
        one_of("train.attention", self.attention, {"auto", "flex", "sdpa"})
        one_of("train.conv_kernel", self.conv_kernel, {"auto", "torch", "triton"})
        one_of("train.distributed", self.distributed, {"ddp", "fsdp"})
        one_of("train.save_dtype", self.save_dtype, {"bfloat16", "float32"})
        self.compile = enum_value("train.compile", self.compile, COMPILE_MODES, {"false": "off", "true": "model"})
        self.gradient_checkpointing = enum_value("train.gradient_checkpointing", self.gradient_checkpointing,
                                                 CHECKPOINTING_MODES, {"false": "off", "true": "full"})
        for key in ("epochs", "max_steps", "batch_size", "grad_accum", "num_anchors", "log_every",
                    "save_every", "keep_last"):
            positive(f"train.{key}", getattr(self, key))
        positive("train.num_workers", self.num_workers, allow_zero=True)
        positive("train.collective_timeout_minutes", self.collective_timeout_minutes)


SELECTOR_DRAWS = ("candidates", "vocabulary", "unary")
"""eval.decode.selector_draw's values (dflash.drafter.decoding.sampling.SelectorDraw)."""


@dataclass
class DecodeConfig:
    """eval.decode: how an evaluation draws and verifies: sampling (temperature, top-p, top-k, seed), live decoding's
    verifier, DFlash 2's draw and beam, and live decoding's tie margin and warm-up."""

    temperature: float = 0.0
    """Sampling temperature (0 = greedy). Live: drafts sampled from the drafter after the target's transform and
    verified by `verifier`; teacher-forced: the held-out completions are sampled at it and the expected
    acceptance under rejection sampling is reported beside the greedy numbers (dflash.evaluate.teacher_forced)."""
    top_p: float = 1.0
    """Nucleus sampling of target and drafter alike (1 = off); used when temperature > 0."""
    top_k: int = 0
    """Top-k sampling of target and drafter alike (0 = off); used when temperature > 0."""
    seed: int = 0
    """Sampling's randomness (temperature > 0): the seed of the sampled held-out completions and, with the prompt's
    index, of each live decoding; another seed is another sample of the same distributions (error bars)."""
    verifier: str = "rejection"
    """Live mode at temperature > 0: rejection (speculative sampling: lossless, the acceptance servers get),
    seeded (exact match of the target's seeded draws: the output equals plain sampling token for token, and
    accepts less) or exact_match (greedy drafts accepted when they equal the target's sample: how the reference
    benchmark measured its temperature-1 tables)."""
    selector_draw: str = "candidates"
    """DFlash 2 at temperature > 0, what its chain is drawn from (dflash.drafter.decoding.sampling.SelectorDraw):
    candidates (softmax(score / T) over the unary top-K, as the z-lab reference draws), vocabulary (every token: the
    unary logits with the candidates rescored, so a flat target distribution is not capped at the K candidates' mass) or
    unary (the unary head alone, DFlash's drafting). Recorded in summary.json and the metrics' namespace."""
    selector_truncation: bool = False
    """DFlash 2 at temperature > 0: apply top_p / top_k to its draw too. Off (the default) draws from softmax(score /
    temperature), as the z-lab reference decoder does, so that acceptance compares with its; on is an extra,
    recorded in summary.json and in the metrics' namespace (eval/t1-p0.9-sel/...)."""
    selector_beam: int = 1
    """DFlash 2 at temperature 0: beside its greedy walk, draft the chain a beam of this width finds over the
    selector's pairwise scores (the path of the largest expected accepted length under its own probabilities,
    dflash.drafter.dflash2.beam_path): reported as eval/tau_beam (teacher-forced) and eval/live_beam_* (live),
    at the greedy chain's verify cost; 1 = none."""
    tie_margin: float | None = None
    """Live mode: a divergence from plain decoding where plain decoding's top-2 logits are closer than this
    is reported as a numerical tie, not a failure; null = by the target's dtype: 1e-3 for float32 targets, 0.1
    otherwise, or 4 units in the last place of the top logit in that dtype where larger (a bf16 logit of 20 is
    stored to 0.125: a one-rounding difference between batched and one-token forwards is 0.125 there)."""
    warmup_tokens: int = 32
    """Live mode: before the timed decoding, the first prompt is decoded this many tokens, untimed and unscored,
    plainly and by each verifier, so that the kernels' compiles and autotuning are not timed as the first decoding's
    cost (fla's Gated DeltaNet kernels autotune once per kernel and key for an empty Triton cache directory,
    TRITON_CACHE_DIR: 45 s for the first forward of a hybrid target on a fresh H200, minutes in all; the compiles
    are per process); 0 = none. Changes the speedup and timing metrics only."""

    def __post_init__(self) -> None:
        positive("eval.decode.temperature", self.temperature, allow_zero=True)
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"eval.decode.top_p={self.top_p} must be in (0, 1] (1 = off)")
        positive("eval.decode.top_k", self.top_k, allow_zero=True)
        one_of("eval.decode.verifier", self.verifier, {"rejection", "seeded", "exact_match"})
        one_of("eval.decode.selector_draw", self.selector_draw, set(SELECTOR_DRAWS))
        positive("eval.decode.selector_beam", self.selector_beam)
        positive("eval.decode.warmup_tokens", self.warmup_tokens, allow_zero=True)


@dataclass
class SuiteConfig:
    """eval.suite: benchmarks evaluated each on its own (evaluate.py only), and how, so that a number is computed
    as the published figures were."""

    name: str | None = None
    """Benchmarks to evaluate, each reported on its own: zlab (the reference benchmark's five: gsm8k, math500,
    humaneval, mbpp, mt_bench), paper (the nine of the reference figures), math, code, chat, coding
    (builtin:eval_coding) or names joined by + (gsm8k+humaneval); null = eval.prompts alone
    (dflash.evaluate.suites). evaluate.py only: the in-run evaluation stays on eval.prompts."""
    benchmarks_dir: str | None = None
    """Folder holding the suite's benchmark files (<name>.jsonl, <name>.parquet or a datasets folder <name>/)."""
    references: str | None = None
    """Published figures shown beside a suite's rows: a YAML file, or a name in conf/references/ (dflash_paper)."""
    protocol: str = "zlab"
    """How a suite's benchmarks are sampled, prompted and averaged, so that our number is computed as the reference
    figures were (dflash.evaluate.suites.PROTOCOLS): zlab (z-lab dflash 0.1.0 benchmark.py: prompts taken after
    random.Random(42).shuffle, the chat template's thinking default unless eval.suite.thinking, both MT-Bench turns, the
    mean over requests of each request's tau), zlab_bb48ef9 (the benchmark.py of the README tables in
    conf/references/dflash_paper.yaml: thinking off, both turns, mean over requests) or first_turn (the first
    records, data.enable_thinking, first user turns only, the pooled walk tau)."""
    thinking: bool | None = None
    """A suite's thinking switch under protocol zlab (the reference benchmark's --reasoning on/off): null leaves
    the chat template's default (on for Qwen3 and Qwen3.5/3.6)."""

    def __post_init__(self) -> None:
        if self.name is not None and not self.name.strip():
            raise ConfigError("eval.suite.name is empty: give a suite (zlab, paper, math, code, chat, coding) or null")
        if self.references is not None and self.name is None:
            raise ConfigError("eval.suite.references are shown per benchmark: set eval.suite.name too (e.g. "
                              "eval.suite.name=paper)")
        one_of("eval.suite.protocol", self.protocol, {"zlab", "zlab_bb48ef9", "first_turn"})


@dataclass
class ServingModelConfig:
    """eval.serving: live mode's prediction of what the drafter buys on a serving engine (dflash.plan.serving)."""

    gpu: str = "h200"
    """Live mode: the GPU (h200, h100, a100) whose roofline turns the measured live tau into the serving model's
    predicted speedup at each of eval.serving.concurrency (dflash.plan.serving: a model, not a measurement)."""
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32])
    """Live mode: the concurrencies the serving model predicts the drafter's speedup at, as
    eval/live_serving@<C>_speedup ([] for none)."""

    def __post_init__(self) -> None:
        one_of("eval.serving.gpu", self.gpu.lower(), set(SERVING_GPUS))
        for c in self.concurrency:
            positive("eval.serving.concurrency[*]", c)


@dataclass
class EvalConfig:
    """Held-out evaluation, in-run and from evaluate.py."""

    prompts: str = "builtin:eval_coding"
    """Held-out prompts (same formats as data.prompts); conf/eval sets them to data.eval_prompts (the toy data:
    toy:stdlib_eval, else builtin:eval_coding = the ten shipped coding tasks)."""
    completions_path: str | None = None
    """Cached held-out completions (JSONL); null = generated greedily by the target, stored next to the features."""
    features_dir: str | None = None
    """Feature cache of the held-out set; null = cache/<target>/eval-<prompts>-n<max_new_tokens>/features."""
    max_new_tokens: int = 256
    """Length of the greedy held-out completions (and of live decoding)."""
    completions_batch_size: int = 32
    """Held-out prompts per generate call (source hf), left-padded, longest first (as data.completions.batch_size).
    In float32 the answers are the target's own greedy tokens either way (the toy target's, batched and alone:
    tests/data/test_completions.py). In bfloat16 padding can flip a real target's greedy token at a near tie, so its
    held-out answers may part from what live decoding writes one prompt at a time: 1 generates each alone, unpadded,
    where teacher-forced and live figures must agree block for block. Part of the held-out set's key when > 1."""
    mode: str = "teacher_forced"
    """teacher_forced (features of the greedy completion) or live (real speculative decoding)."""
    every: int = 0
    """Evaluate during training every this many steps (0 = only at the end)."""
    at_start: bool = True
    """Also evaluate the untrained drafter at step 0: the baseline every run is compared with."""
    anchor_region: str = "response"
    """response (anchors in the completion, as in training) or all (every position)."""
    anchor_stride: int = 1
    """Use every n-th eligible anchor."""
    max_blocks: int | None = None
    """Evaluate at most this many blocks per prompt."""
    max_prompts: int | None = None
    """Evaluate at most this many prompts."""
    ddtree_budgets: list[int] = field(default_factory=lambda: [4, 8, 16, 32])
    """DDTree node budgets N for ddtree@N."""
    topk_logits: int = 256
    """At temperature > 0, the held-out set stores the target's top-k next-token distribution, k = this, for the
    expected acceptance: exact when k covers the vocabulary or eval.decode.top_k <= k; otherwise at temperature 1 alpha
    is an upper bound (the other tokens are one bucket), at other temperatures the k tokens are renormalised
    (dflash.drafter.decoding.sampling.stored_probs)."""
    compare: list[str] = field(default_factory=list)
    """Other drafter directories (z-lab layout) evaluated on exactly the same blocks, each a row labelled by its
    folder's name or, where two drafters (the checkpoint too) share one, by the shortest end of their paths that
    tells them apart (run_a/export, run_b/export); results in <eval dir>/compare/<label, '/' as '__'>/. name=path
    sets a label ('eval.compare=["zlab=/models/b16"]', quoted for Hydra); a label two drafters would share is
    refused (dflash.evaluate.runner.drafter_labels)."""
    turns: str = "all"
    """Which user turns of a multi-turn held-out prompt are evaluated: all (each its own request, the earlier
    assistant turns the target's own answers, teacher-forced and live alike) or first. A suite's protocol sets it."""
    slices: list[str] = field(default_factory=list)
    """Also report tau per slice of the held-out set (dflash.evaluate.slices): source (the mixture's sources),
    thinking (on, off, the template's default), tools (tool-call turns against text turns), length (the block's
    context: 0-2k, 2-8k, 8-32k, 32k+ tokens); e.g. eval.slices=[thinking,length]. As eval/slice/<kind>/<name>/tau
    (live: eval/live/slice/...)."""
    plots: bool = True
    """Write PNG plots next to summary.json."""
    dtype: str = "auto"
    """Dtype the drafter is evaluated in: auto = the target's (what SGLang and vLLM serve it in: bfloat16 for the
    Qwen presets, float32 for the float32 toy and tiny targets), bfloat16, or float32 (the training weights as
    they are; slower). Recorded in summary.json."""
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    """Sampling, verification and DFlash 2's draw (eval.decode.temperature, eval.decode.verifier, ...)."""
    suite: SuiteConfig = field(default_factory=SuiteConfig)
    """Benchmarks reported each on its own (eval.suite.name=zlab, eval.suite.benchmarks_dir, ...); evaluate.py only."""
    serving: ServingModelConfig = field(default_factory=ServingModelConfig)
    """Live mode's serving model (eval.serving.gpu, eval.serving.concurrency)."""

    def __post_init__(self) -> None:
        one_of("eval.mode", self.mode, {"teacher_forced", "live"})
        one_of("eval.anchor_region", self.anchor_region, {"response", "all"})
        one_of("eval.dtype", self.dtype, {"auto", "bfloat16", "float32"})
        for key in ("max_new_tokens", "completions_batch_size", "anchor_stride", "max_blocks", "max_prompts"):
            positive(f"eval.{key}", getattr(self, key))
        positive("eval.every", self.every, allow_zero=True)
        for kind in self.slices:
            one_of("eval.slices[*]", kind, {"source", "thinking", "tools", "length"})
        one_of("eval.turns", self.turns, {"all", "first"})
        positive("eval.topk_logits", self.topk_logits)
        for n in self.ddtree_budgets:
            positive("eval.ddtree_budgets[*]", n)


@dataclass
class LoggerConfig:
    """Experiment tracking. metrics.jsonl in the run folder is always written."""

    backend: str = "wandb"
    """wandb or none."""
    project: str = "dflash"
    """W&B project."""
    entity: str | None = None
    """W&B entity (team or user); null = your default."""
    mode: str = "offline"
    """W&B mode: online, offline (sync later with `wandb sync`) or disabled."""
    group: str | None = None
    """W&B group; null = the sweep name in multirun, else none."""
    tags: list[str] = field(default_factory=list)
    """Extra W&B tags."""

    def __post_init__(self) -> None:
        one_of("logger.backend", self.backend, {"wandb", "none"})
        one_of("logger.mode", self.mode, {"online", "offline", "disabled"})


@dataclass
class RunConfig:
    """Where a run lives: runs/<name>/."""

    root: str = "runs"
    """Folder holding all run folders."""
    name: str | None = None
    """Run folder name; null = <date>-<time>-<target>(-<overrides> in multirun) for training,
    the most recent run for evaluation."""
    compile_cache: str | None = None
    """Folder of the Triton and TorchInductor compile caches (triton/, inductor/), shared by every run and process
    so compiled kernels and autotuning results are reused; null = $DFLASH_HOME/compile-cache (~/.cache/dflash/
    compile-cache). A TRITON_CACHE_DIR or TORCHINDUCTOR_CACHE_DIR you export wins over it."""

    def __post_init__(self) -> None:
        if self.compile_cache is not None:
            if not str(self.compile_cache).strip():
                raise ConfigError("run.compile_cache is empty: give a folder (e.g. run.compile_cache=/scratch/dflash-"
                                  "compile) or null for $DFLASH_HOME/compile-cache")
            if Path(self.compile_cache).expanduser().is_file():
                raise ConfigError(f"run.compile_cache={self.compile_cache} is a file: give a folder (created when "
                                  f"missing) or null for $DFLASH_HOME/compile-cache")


@dataclass
class ProvenanceConfig:
    """How strictly features must match what a checkpoint was trained on."""

    allow_mismatch: list[str] = field(default_factory=list)
    """Manifest fields allowed to differ (e.g. [kernel_backend]); each use is logged. The fields are
    listed (and these names checked when the entry points start) in dflash.provenance."""
