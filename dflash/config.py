"""Typed configuration: one dataclass per concern, registered with Hydra's ConfigStore.

The YAML groups under ``conf/`` are merged onto these schemas, so an unknown key or a value
of the wrong type fails at compose time, and the cross-field checks in ``__post_init__`` run
when the entry points call ``OmegaConf.to_object``. Library code only ever sees these
dataclasses, never a ``DictConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from dflash.errors import ConfigError  # the one dflash import: a leaf module of exception classes


def _one_of(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not valid; expected one of {sorted(allowed)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


@dataclass
class TargetConfig:
    """The frozen target LLM whose hidden states condition the drafter."""

    name: str = MISSING
    """Preset name; used in run names, cache paths and messages."""
    path: str = MISSING
    """Hugging Face model id or local directory of the target."""
    build: str | None = None
    """Built-in target recipe (tiny_qwen3, tiny_qwen3_5, toy): built into `path` on first use."""
    mask_token_id: int = MISSING
    """Token id fed at every masked block slot (an embedding row of the target)."""
    num_layers: int | None = None
    """Expected number of decoder layers; checked against the loaded model when set."""
    dtype: str = "bfloat16"
    """Weights and activations dtype of the target: float32, bfloat16 or float16."""
    device: str = "auto"
    """auto (this process's accelerator, else CPU), cpu, cuda or cuda:N."""
    attn_implementation: str = "sdpa"
    """Attention kernel of the target's full-attention layers (sdpa, eager, flash_attention_2)."""
    allow_fallback_kernels: bool = False
    """On CUDA, accept the PyTorch fallback for linear-attention layers instead of fla kernels."""
    trust_remote_code: bool = False
    """Run modelling code shipped with the checkpoint. Off unless you trust its source."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when `path` is a hub id."""

    def __post_init__(self) -> None:
        _one_of("target.dtype", self.dtype, {"float32", "bfloat16", "float16"})
        _positive("target.num_layers", self.num_layers)
        if self.build is not None:
            _one_of("target.build", self.build, {"tiny_qwen3", "tiny_qwen3_5", "toy"})
        if not (self.device in {"auto", "cpu", "cuda"} or self.device.startswith("cuda:")):
            raise ConfigError(f"target.device={self.device!r}: use auto, cpu, cuda or cuda:N")


@dataclass
class LayersConfig:
    """Which target layers feed the drafter's `fc`."""

    ids: list[int] | None = None
    """Explicit target layer ids; null uses the reference formula with `num` layers."""
    num: int = 5
    """How many layers the reference formula picks (between layer 1 and layer T-3)."""
    allow_last_layer: bool = False
    """Allow the target's last layer (the one its logits are made from): trains well, serves badly."""

    def __post_init__(self) -> None:
        _positive("layers.num", self.num)
        if self.ids is not None:
            if len(self.ids) == 0:
                raise ConfigError("layers.ids is empty; give at least one layer id or set it to null")
            if len(set(self.ids)) != len(self.ids):
                raise ConfigError(f"layers.ids={self.ids} repeats a layer")


@dataclass
class DrafterConfig:
    """Shape of the DFlash drafter. Width and heads default to the target's."""

    num_layers: int = 5
    """Number of drafter decoder layers."""
    block_size: int = 16
    """Tokens drafted per block (slot 0 is the last committed token)."""
    layer_types: list[str] | None = None
    """Per drafter layer: full_attention or sliding_attention; null means all full."""
    sliding_window: int | None = None
    """Window of the sliding_attention layers, in tokens."""
    num_attention_heads: int | None = None
    """Query heads; null copies the target's."""
    num_key_value_heads: int | None = None
    """Key/value heads; null copies the target's."""
    head_dim: int | None = None
    """Per-head width; null copies the target's."""
    intermediate_size: int | None = None
    """MLP width; null copies the target's."""
    init_from: str | None = None
    """Start from the weights of this drafter directory (z-lab layout) instead of a random init."""

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise ConfigError(f"drafter.block_size={self.block_size}: a block needs at least 2 slots")
        _positive("drafter.num_layers", self.num_layers)
        for key in ("sliding_window", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size"):
            _positive(f"drafter.{key}", getattr(self, key))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"drafter.layer_types has {len(self.layer_types)} entries but "
                    f"drafter.num_layers={self.num_layers}; give one type per layer")
            for t in self.layer_types:
                _one_of("drafter.layer_types[*]", t, {"full_attention", "sliding_attention"})
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError("drafter.layer_types uses sliding_attention but "
                                  "drafter.sliding_window is null; set the window size")

    def resolved_layer_types(self) -> list[str]:
        return list(self.layer_types) if self.layer_types else ["full_attention"] * self.num_layers


@dataclass
class NoiseConfig:
    """Augmentation of the context features fed to the drafter (never of labels)."""

    kind: str = "none"
    """none, gaussian (std = scale x feature RMS) or uniform (half-width = scale x feature RMS)."""
    scale: float = 0.0
    """Noise magnitude relative to the per-token RMS of the features."""

    def __post_init__(self) -> None:
        _one_of("noise.kind", self.kind, {"none", "gaussian", "uniform"})
        _positive("noise.scale", self.scale, allow_zero=True)
        if self.kind != "none" and self.scale == 0:
            raise ConfigError(f"noise.kind={self.kind} with noise.scale=0 adds nothing; set a scale")


DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


@dataclass
class LossConfig:
    """Decay-weighted cross-entropy over block slots."""

    gamma: float | None = None
    """Decay of slot weights w_k = exp(-(k-1)/gamma); null picks 7/5/4 for block size 16/10/8."""
    chunk_logits: int = 134217728
    """Largest logits tensor (rows x vocab elements) made at once; above it the loss runs in row chunks,
    recomputed in backward, so [anchors x block x vocab] never exists whole (0 = never chunk)."""

    def __post_init__(self) -> None:
        _positive("loss.gamma", self.gamma)
        _positive("loss.chunk_logits", self.chunk_logits, allow_zero=True)

    def gamma_for(self, block_size: int) -> float:
        if self.gamma is not None:
            return self.gamma
        if block_size not in DEFAULT_GAMMA:
            raise ConfigError(f"loss.gamma has no default for block size {block_size} "
                              f"(defaults exist for {sorted(DEFAULT_GAMMA)}); set loss.gamma")
        return DEFAULT_GAMMA[block_size]


@dataclass
class CompletionsConfig:
    """Where the responses to the prompts come from (regenerated by the target, as in the paper)."""

    source: str = "hf"
    """cached (read `path`, never generate), hf (target.generate in-process) or server."""
    path: str | None = None
    """JSONL of completions: read for `cached`, written and resumed for hf/server; null = next to the cache."""
    max_new_tokens: int = 512
    """Longest completion, in tokens."""
    batch_size: int = 8
    """Prompts per generate call (hf)."""
    url: str = "http://localhost:30000/v1"
    """OpenAI-compatible endpoint (SGLang, vLLM) for source=server."""
    model: str | None = None
    """Model name sent to the server; null uses target.path."""
    concurrency: int = 8
    """Requests in flight at once (server)."""
    ready_timeout_s: float = 600.0
    """How long to wait for the server to come up before failing."""
    request_timeout_s: float = 600.0
    """Timeout of a single completion request."""
    retries: int = 5
    """Attempts per request (with exponential backoff) before failing."""
    stop: list[str] = field(default_factory=list)
    """Extra stop strings; the tokenizer's end-of-turn tokens always stop."""

    def __post_init__(self) -> None:
        _one_of("data.completions.source", self.source, {"cached", "hf", "server"})
        if self.source == "cached" and not self.path:
            raise ConfigError("data.completions.source=cached needs data.completions.path (a JSONL file)")
        for key in ("max_new_tokens", "batch_size", "concurrency", "ready_timeout_s",
                    "request_timeout_s", "retries"):
            _positive(f"data.completions.{key}", getattr(self, key))


@dataclass
class DataConfig:
    """Prompts, chat formatting and the completions that make the training sequences."""

    name: str = MISSING
    """Dataset name; used in cache paths and run names."""
    prompts: str = MISSING
    """A .jsonl or .parquet file, a directory of them, or a saved HF dataset; builtin: for shipped sets."""
    format: str = "auto"
    """auto (by extension), jsonl, parquet or hf (datasets.load_dataset / load_from_disk on local files)."""
    split: str = "train"
    """Split to read for format=hf."""
    prompt_key: str = "auto"
    """Record field with the prompt: a string, or a list of chat messages; auto tries messages/conversations/prompt/text."""
    limit: int | None = None
    """Use at most this many prompts (after skipping `offset`)."""
    offset: int = 0
    """Skip this many prompts first."""
    max_length: int = 3072
    """Longest prompt+response in tokens; longer sequences are truncated (responses) or skipped (prompts)."""
    chat_template: bool = True
    """Wrap prompts with the tokenizer's chat template."""
    enable_thinking: bool = False
    """Passed to the chat template (Qwen3 thinking mode)."""
    completions: CompletionsConfig = field(default_factory=CompletionsConfig)

    def __post_init__(self) -> None:
        _one_of("data.format", self.format, {"auto", "jsonl", "parquet", "hf"})
        _positive("data.limit", self.limit)
        _positive("data.offset", self.offset, allow_zero=True)
        if self.max_length < 4:
            raise ConfigError(f"data.max_length={self.max_length} is too short for prompt + response")


@dataclass
class FeaturesConfig:
    """The on-disk cache of target features (written by extract.py, read by offline training)."""

    dir: str = MISSING
    """Cache directory (holds manifest.json and shards)."""
    storage: str = "bfloat16"
    """bfloat16, or float8_e4m3fn with a per-token scale (about half the bytes)."""
    shard_sequences: int = 256
    """Sequences per safetensors shard."""
    batch_tokens: int = 16384
    """Token budget of one padded extraction batch."""

    def __post_init__(self) -> None:
        _one_of("features.storage", self.storage, {"bfloat16", "float8_e4m3fn", "float32"})
        _positive("features.shard_sequences", self.shard_sequences)
        _positive("features.batch_tokens", self.batch_tokens)


@dataclass
class OptimConfig:
    """AdamW with warmup and a cosine (or constant) schedule."""

    lr: float = 6e-4
    """Peak learning rate."""
    weight_decay: float = 0.01
    """AdamW weight decay (torch's default)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    schedule: str = "cosine"
    """cosine or constant (after warmup)."""
    warmup_ratio: float = 0.04
    """Fraction of all steps spent warming up linearly from 0."""
    min_lr_ratio: float = 0.0
    """Final learning rate as a fraction of `lr` (cosine)."""
    grad_clip: float = 1.0
    """Max global grad norm (0 disables clipping)."""

    def __post_init__(self) -> None:
        _positive("optim.lr", self.lr)
        _one_of("optim.schedule", self.schedule, {"cosine", "constant"})
        if not 0 <= self.warmup_ratio < 1:
            raise ConfigError(f"optim.warmup_ratio={self.warmup_ratio} must be in [0, 1)")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio} must be in [0, 1]")
        if len(self.betas) != 2:
            raise ConfigError(f"optim.betas={self.betas} needs two values")
        _positive("optim.grad_clip", self.grad_clip, allow_zero=True)


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
    compile: bool = False
    """torch.compile the drafter."""
    distributed: str = "ddp"
    """ddp, or fsdp for drafters too large to replicate."""
    gradient_checkpointing: bool = False
    """Recompute drafter layer activations in backward to save memory."""
    num_workers: int = 1
    """DataLoader worker processes."""

    def __post_init__(self) -> None:
        _one_of("train.mode", self.mode, {"offline", "online"})
        _one_of("train.mixed_precision", self.mixed_precision, {"auto", "no", "bf16"})
        _one_of("train.attention", self.attention, {"auto", "flex", "sdpa"})
        _one_of("train.distributed", self.distributed, {"ddp", "fsdp"})
        for key in ("epochs", "max_steps", "batch_size", "grad_accum", "num_anchors", "log_every",
                    "save_every", "keep_last"):
            _positive(f"train.{key}", getattr(self, key))
        _positive("train.num_workers", self.num_workers, allow_zero=True)


@dataclass
class EvalConfig:
    """Held-out evaluation, in-run and from evaluate.py."""

    prompts: str = "builtin:eval_coding"
    """Held-out prompts (same formats as data.prompts); builtin:eval_coding = the ten shipped coding tasks."""
    completions_path: str | None = None
    """Cached held-out completions (JSONL); null = generated greedily by the target, stored next to the features."""
    features_dir: str | None = None
    """Feature cache of the held-out set; null = cache/<target>/eval-<prompts>-n<max_new_tokens>/features."""
    max_new_tokens: int = 256
    """Length of the greedy held-out completions (and of live decoding)."""
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
    temperature: float = 0.0
    """Live mode sampling temperature (0 = greedy; >0 verifies by exact match of sampled tokens)."""
    compare: list[str] = field(default_factory=list)
    """Other drafter directories (z-lab layout) evaluated on exactly the same blocks."""
    plots: bool = True
    """Write PNG plots next to summary.json."""
    tie_margin: float | None = None
    """Live mode: a divergence from plain decoding where plain decoding's top-2 logits are closer than this
    is reported as a numerical tie, not a failure; null = 1e-3 for float32 targets, 0.1 otherwise."""

    def __post_init__(self) -> None:
        _one_of("eval.mode", self.mode, {"teacher_forced", "live"})
        _one_of("eval.anchor_region", self.anchor_region, {"response", "all"})
        for key in ("max_new_tokens", "anchor_stride", "max_blocks", "max_prompts"):
            _positive(f"eval.{key}", getattr(self, key))
        _positive("eval.every", self.every, allow_zero=True)
        _positive("eval.temperature", self.temperature, allow_zero=True)
        for n in self.ddtree_budgets:
            _positive("eval.ddtree_budgets[*]", n)


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
        _one_of("logger.backend", self.backend, {"wandb", "none"})
        _one_of("logger.mode", self.mode, {"online", "offline", "disabled"})


@dataclass
class RunConfig:
    """Where a run lives: runs/<name>/."""

    root: str = "runs"
    """Folder holding all run folders."""
    name: str | None = None
    """Run folder name; null = <date>-<time>-<target>(-<overrides> in multirun) for training,
    the most recent run for evaluation."""


@dataclass
class ProvenanceConfig:
    """How strictly features must match what a checkpoint was trained on."""

    allow_mismatch: list[str] = field(default_factory=list)
    """Manifest fields allowed to differ (e.g. [kernel_backend]); each use is logged. The fields are
    listed (and these names checked when the entry points start) in dflash.provenance."""


@dataclass
class JobConfig:
    """Groups shared by every entry point, so one command line works for all three."""

    target: TargetConfig = MISSING
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    layers: LayersConfig = field(default_factory=LayersConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = MISSING
    features: FeaturesConfig = MISSING
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    run: RunConfig = field(default_factory=RunConfig)
    provenance: ProvenanceConfig = field(default_factory=ProvenanceConfig)
    checkpoint: str = "latest"
    """evaluate.py: latest, best, stepN / stepNk, or a drafter directory (z-lab layout)."""


@dataclass
class ReportConfig:
    """python -m dflash.report: compare run folders without the W&B UI."""

    runs: Any = field(default_factory=lambda: ["all"])
    """Run names under `root`, run folders, or sweep folders (their runs), as a list; all = every run."""
    root: str = "runs"
    """Folder holding the run folders."""
    out: str | None = None
    """Where report.md/html and the PNGs go; null = <root>/reports/<run names>."""

    def __post_init__(self) -> None:
        if isinstance(self.runs, str):
            self.runs = [self.runs]
        if not self.runs or not all(isinstance(r, str) and r for r in self.runs):
            raise ConfigError(f"runs={self.runs!r}: give run names, e.g. runs=[run_a,run_b], or runs=all")


def register_configs() -> None:
    """Register the schemas so conf/*.yaml are validated against them (`defaults: [schema]`)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name="schema", node=JobConfig)
    ConfigStore.instance().store(name="report_schema", node=ReportConfig)
