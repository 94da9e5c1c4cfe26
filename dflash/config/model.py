"""What is trained on what: the target, its layers, the drafter's shape, noise and loss."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import MISSING

from dflash.config.checks import ConfigError, one_of, positive


BUILDS = ("toy", "tiny_qwen3", "tiny_qwen3_sliding", "tiny_qwen3_hd32", "tiny_qwen3_tools", "tiny_qwen3_5",
          "tiny_qwen3_moe", "tiny_qwen3_5_moe", "tiny_llama", "tiny_gemma", "tiny_gpt_oss")
"""The built-in targets (dflash.target.builtin): the toy, and tiny random-weight ones of each supported family."""


@dataclass
class TargetConfig:
    """The frozen target LLM whose hidden states condition the drafter."""

    name: str = MISSING
    """Preset name; used in run names, cache paths and messages."""
    path: str = MISSING
    """Hugging Face model id or local directory of the target."""
    build: str | None = None
    """Built-in target recipe (toy, or a tiny random-weight one of BUILDS): built into `path` on first use."""
    gguf: str | None = None
    """A GGUF file to make the target from (a path, or pkg:<package>/<file> for one a Python package ships):
    dequantized once into `path` (float32), then loaded from there (dflash.target.gguf)."""
    mask_token_id: int = MISSING
    """Token id fed at every masked block slot (an embedding row of the target): a token the model never writes
    (not its end of turn, padding or any token its chat template or generation config can produce)."""
    mask_token: str | None = None
    """The text of mask_token_id in the target's tokenizer ("" for an embedding row past the tokenizer's tokens),
    checked when the target loads, so a preset's mask token is never silently reused for another model (a new
    target.path with the old id): the presets set it; null = not checked."""
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
    tensor_parallel: int = 1
    """Shard the target over this many processes with transformers' tensor-parallel plan (an MoE target's
    experts too), for targets bigger than one GPU: launch with torchrun or accelerate; each group of this many
    consecutive processes holds one target and runs every process's forwards together (dflash.target.sharding)."""
    device_map: str | None = None
    """Place the target's layers over this process's GPUs (accelerate: auto, balanced, balanced_low_0,
    sequential) instead of loading it on one device; null = one device (target.device)."""

    def __post_init__(self) -> None:
        one_of("target.dtype", self.dtype, {"float32", "bfloat16", "float16"})
        positive("target.tensor_parallel", self.tensor_parallel)
        if self.device_map is not None:
            one_of("target.device_map", self.device_map, {"auto", "balanced", "balanced_low_0", "sequential"})
            if self.tensor_parallel > 1:
                raise ConfigError(f"target.tensor_parallel={self.tensor_parallel} and target.device_map="
                                  f"{self.device_map} both lay the target out; choose one (transformers refuses both)")
        positive("target.num_layers", self.num_layers)
        if self.build is not None:
            one_of("target.build", self.build, set(BUILDS))
            if self.gguf is not None:
                raise ConfigError(f"target.build={self.build} and target.gguf={self.gguf} both make the target; "
                                  f"set target.build=null to make it from the GGUF file")
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
        positive("layers.num", self.num)
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
    init_layers: list[int] | None = None
    """Target layer ids whose decoder weights initialise the drafter's layers, one id per drafter layer (attention
    and MLP projections and norms where the shapes match: the drafter's width, heads and MLP left to the target's),
    and the drafter's final norm from the target's; null = a random init."""
    sliding_causal: bool | None = None
    """Whether sliding_attention layers are causal inside the block (a window of W keys ending at each query)
    or see the whole block both ways plus the context within W positions; null = the kind's default: causal
    for dflash (as SGLang/vLLM serve DFlash drafters), non-causal for dflash2 (as DFlash 2 trainers export:
    dflash_config.causal false). Full-attention layers always see the whole block."""
    kind: str = "dflash"
    """dflash, or dflash2: DFlash 2's grouped dynamic convolutions around every sublayer and its candidate
    selector on the target head (DESIGN §2b; exported as DFlash2DraftModel)."""
    conv_kernel_size: int = 2
    """dflash2: taps of each grouped dynamic convolution (offsets 0..k-1 within the block)."""
    conv_group_size: int = 16
    """dflash2: channels sharing one dynamic tap (groups = hidden / this)."""
    selector_rank: int = 256
    """dflash2: rank r of the selector's predecessor/successor codebooks [vocab, r]."""
    selector_top_k: int = 32
    """dflash2: candidates K per slot, the unary top-K of the target head's logits. 32 since issue 50's sweep (walk
    tau +0.07 over 16 on the toy, docs/results/2026-12-03-dflash2.md); the published drafters' 16 is the
    drafter=dflash2 presets'."""

    def __post_init__(self) -> None:
        one_of("drafter.kind", self.kind, {"dflash", "dflash2"})
        for key in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            positive(f"drafter.{key}", getattr(self, key))
        if self.block_size < 2:
            raise ConfigError(f"drafter.block_size={self.block_size}: a block needs at least 2 slots")
        positive("drafter.num_layers", self.num_layers)
        if self.init_layers is not None and len(self.init_layers) != self.num_layers:
            raise ConfigError(f"drafter.init_layers={self.init_layers} gives {len(self.init_layers)} target layers for "
                              f"drafter.num_layers={self.num_layers}: give one target layer id per drafter layer")
        for key in ("sliding_window", "num_attention_heads", "num_key_value_heads", "head_dim",
                    "intermediate_size"):
            positive(f"drafter.{key}", getattr(self, key))
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ConfigError(
                    f"drafter.layer_types has {len(self.layer_types)} entries but "
                    f"drafter.num_layers={self.num_layers}; give one type per layer")
            for t in self.layer_types:
                one_of("drafter.layer_types[*]", t, {"full_attention", "sliding_attention"})
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ConfigError("drafter.layer_types uses sliding_attention but "
                                  "drafter.sliding_window is null; set the window size")

    def resolved_layer_types(self) -> list[str]:
        return list(self.layer_types) if self.layer_types else ["full_attention"] * self.num_layers

    def resolved_sliding_causal(self) -> bool:
        return self.kind == "dflash" if self.sliding_causal is None else self.sliding_causal

    def dflash2_keys(self) -> dict | None:
        """The DFlash 2 keys of the drafter's config.json (None for kind=dflash)."""
        if self.kind != "dflash2":
            return None
        return {"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
                "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}


@dataclass
class NoiseConfig:
    """Augmentation of the context features fed to the drafter (never of labels)."""

    kind: str = "none"
    """none, gaussian (std = scale x feature RMS) or uniform (half-width = scale x feature RMS)."""
    scale: float = 0.0
    """Noise magnitude relative to the per-token RMS of the features."""

    def __post_init__(self) -> None:
        one_of("noise.kind", self.kind, {"none", "gaussian", "uniform"})
        positive("noise.scale", self.scale, allow_zero=True)
        if self.kind != "none" and self.scale == 0:
            raise ConfigError(f"noise.kind={self.kind} with noise.scale=0 adds nothing; set a scale")


DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}
ACCEPTANCE_OBJECTIVES = ("tv", "nla", "expected_tau")  # made of the acceptance rates (dflash.drafter.loss)
SOFT_OBJECTIVES = ("kl", *ACCEPTANCE_OBJECTIVES)  # read the target's next-token distribution
SELECTOR_CHOICES = {"gradient": ("coupled", "detach_unary", "stop"), "gold": ("inject", "strict"),
                    "weights": ("decay", "follow"), "init": ("normal", "zero"), "labels": ("data", "target"),
                    "span": ("free", "embedding", "predecessor")}
"""The values of loss.selector.<key> (dflash.drafter.selector_loss says what each does)."""


@dataclass
class SelectorLossConfig:
    """loss.selector: DFlash 2's candidate selector, its K-way cross-entropy and how it is trained and served
    (dflash.drafter.selector_loss)."""

    weight: float = 1.0
    """dflash2: weight of the selector's K-way cross-entropy (over the unary top-K, the previous gold token as
    predecessor) added to the per-slot loss (loss.objective's); the keys below say how it is formed."""
    gradient: str = "coupled"
    """dflash2: coupled (the selector's gradient reaches the unary logits too; the default since issue 50's sweep:
    +0.049 walk tau over detach_unary on the toy, 3 of 3 seeds, at the same step cost), detach_unary (it does not;
    the default before) or stop (nor the hidden states: it trains the codebooks and projection only)."""
    gold: str = "inject"
    """dflash2: inject (a gold token outside the unary top-K takes the K-th place in the loss) or strict (such a
    row gives no selector loss and leaves its normaliser)."""
    warmup_ratio: float = 0.0
    """dflash2: the selector's weight is 0 for this fraction of the steps, then ramps (ramp_ratio)."""
    ramp_ratio: float = 0.0
    """dflash2: fraction of the steps over which the selector's weight rises linearly from 0 to weight."""
    init: str = "normal"
    """dflash2: the successor codebook's init, normal (std 0.02) or zero (step 0 drafts the unary argmax path;
    it still trains: S's gradient is P[prev] (W h), nonzero)."""
    weights: str = "decay"
    """dflash2: the selector's slot weights, decay (exp(-(k-1)/gamma)) or follow (the per-slot loss's: decay or
    D-PACE)."""
    labels: str = "data"
    """dflash2: the selector's gold tokens, data (the labels) or target (the target's argmax there: online, or
    offline from a cache extracted with features.topk_logits)."""
    decay: float | None = None
    """dflash2: AdamW weight decay of the two codebooks; null = optim.weight_decay, as any matrix."""
    dropout: float = 0.0
    """dflash2: dropout on the predecessor's codebook row in the selector's loss (training only), in [0, 1)."""
    shrink: float = 0.6
    """dflash2: the served selector's pairwise term is the trained one times this (its predecessor codebook scaled
    in every checkpoint's servable weights and in in-run evaluation; training's scores and its float32 copy keep
    the trained one); train/tau scores the choice with it. Below 1 it shrinks a selector that over-fits its
    training answers towards the unary scores: 0.6 (issue 50's sweep, docs/results/2026-12-03-dflash2.md); 1 serves it
    as trained."""
    span: str = "free"
    """dflash2: free (each token's codebook rows its own) or embedding (after every optimizer step each codebook is
    projected onto the span of the target's token vectors, its embeddings for the predecessor's and its head's rows
    for the successor's: tokens alike to the target share what the selector learns of them), or predecessor (the
    predecessor's codebook alone)."""

    def __post_init__(self) -> None:
        positive("loss.selector.weight", self.weight, allow_zero=True)
        for key, allowed in SELECTOR_CHOICES.items():
            one_of(f"loss.selector.{key}", getattr(self, key), set(allowed))
        positive("loss.selector.decay", self.decay, allow_zero=True)
        positive("loss.selector.shrink", self.shrink, allow_zero=True)
        for key in ("warmup_ratio", "ramp_ratio"):
            if not 0 <= getattr(self, key) <= 1:
                raise ConfigError(f"loss.selector.{key}={getattr(self, key)} must be in [0, 1] (a fraction of the "
                                  f"steps)")
        if not 0 <= self.dropout < 1:
            raise ConfigError(f"loss.selector.dropout={self.dropout} must be in [0, 1)")
        if self.warmup_ratio + self.ramp_ratio > 1:
            raise ConfigError(f"loss.selector.warmup_ratio + loss.selector.ramp_ratio = "
                              f"{self.warmup_ratio + self.ramp_ratio} must be <= 1 (the ramp ends by the last step)")


@dataclass
class LossConfig:
    """The per-slot training loss (dflash.drafter.loss): decay-weighted CE (the paper's), D-PACE, KL, or the
    acceptance rate under speculative sampling (tv, nla, expected_tau)."""

    objective: str = "decay_ce"
    """decay_ce (CE on the target's greedy tokens, weights exp(-(k-1)/gamma)), dpace (CE with D-PACE weights
    from the drafter's own confidence, arXiv 2605.18810), kl (KL(target || drafter) on the target's
    next-token distribution), tv (1 - alpha, alpha = sum_x min(p, q) the slot's acceptance rate), nla
    (-log alpha) or expected_tau (per block, the expected labelled slots not accepted: -E[tau] + const, no
    slot weights, normalised by the blocks). kl and those three need the target's distribution: online, or
    offline from a cache extracted with features.topk_logits."""
    gamma: float | None = None
    """Decay of slot weights w_k = exp(-(k-1)/gamma); null picks 7/5/4 for block size 16/10/8."""
    alpha: float = 0.5
    """D-PACE smoothing of the drafter's confidence q: q~ = (1 - alpha) q + alpha, in (0, 1]."""
    normalize: str | None = None
    """anchor (loss sum / valid anchors) or weights (loss sum / sum of the slot weights); null = weights for
    decay weights (the paper's form), anchor for D-PACE weights (the form the D-PACE author recommends)."""
    kl_weights: str = "decay"
    """Slot weights of loss=kl, tv and nla: decay (as decay_ce) or dpace."""
    temperature: float = 1.0
    """Temperature T of tv, nla and expected_tau: alpha compares softmax(logits / T) of target and drafter."""
    selector: SelectorLossConfig = field(default_factory=SelectorLossConfig)
    """dflash2: the candidate selector's loss (loss.selector.weight, loss.selector.shrink, ...)."""
    chunk_logits: int = 134217728
    """Largest logits tensor (rows x vocab elements) made at once; above it the loss runs in row chunks, so
    [anchors x block x vocab] never exists whole (0 = never chunk)."""
    fused_ce: bool = True
    """Chunked decay_ce (and DFlash 2's selector CE): each chunk's gradients are made in the forward, from the
    logits made once (dflash.drafter.head_ce.py); false = each chunk is recomputed in backward (activation
    checkpointing: the head's matmul and softmax twice). The soft objectives always recompute, and so does the
    selector under FSDP."""

    def __post_init__(self) -> None:
        one_of("loss.objective", self.objective, {"decay_ce", "dpace", *SOFT_OBJECTIVES})
        one_of("loss.kl_weights", self.kl_weights, {"decay", "dpace"})
        if self.normalize is not None:
            one_of("loss.normalize", self.normalize, {"anchor", "weights"})
        if not 0 < self.alpha <= 1:
            raise ConfigError(f"loss.alpha={self.alpha} must be in (0, 1] (1 = uniform D-PACE weights)")
        positive("loss.gamma", self.gamma)
        positive("loss.chunk_logits", self.chunk_logits, allow_zero=True)
        if not self.temperature > 0:
            raise ConfigError(f"loss.temperature={self.temperature} must be > 0 (1 = the distributions as they are)")
        if self.temperature != 1 and self.objective not in ACCEPTANCE_OBJECTIVES:
            raise ConfigError(f"loss.temperature={self.temperature} applies to loss=tv, nla or expected_tau, not "
                              f"loss={self.objective}: leave it at 1")
        if self.objective == "expected_tau" and self.kl_weights != "decay":
            raise ConfigError(f"loss.kl_weights={self.kl_weights}: loss=expected_tau is a per-block loss without "
                              f"slot weights; leave loss.kl_weights at decay")
        if self.objective == "expected_tau" and self.normalize == "weights":
            raise ConfigError("loss.normalize=weights: loss=expected_tau has no slot weights, it is normalised by "
                              "the blocks with a label; set loss.normalize=anchor or null")

    @property
    def weighting(self) -> str:
        """decay or dpace: how the slots are weighted."""
        return "dpace" if self.objective == "dpace" or (self.objective in ("kl", "tv", "nla") and
                                                         self.kl_weights == "dpace") else "decay"

    @property
    def normalizer(self) -> str:
        """anchor or weights (loss.normalize, or its default for the weighting; expected_tau: anchor, one count
        per block with a label)."""
        by_anchor = self.weighting == "dpace" or self.objective == "expected_tau"
        return self.normalize or ("anchor" if by_anchor else "weights")

    @property
    def soft_labels(self) -> bool:
        """Whether the loss reads the target's next-token distribution (kl, tv, nla, expected_tau)."""
        return self.objective in SOFT_OBJECTIVES

    def gamma_for(self, block_size: int) -> float:
        if self.gamma is not None:
            return self.gamma
        if block_size not in DEFAULT_GAMMA:
            raise ConfigError(f"loss.gamma has no default for block size {block_size} "
                              f"(defaults exist for {sorted(DEFAULT_GAMMA)}); set loss.gamma")
        return DEFAULT_GAMMA[block_size]
