"""The DFlash drafter: Qwen3-style decoder layers with target-feature KV injection.

Layout and weight names follow the z-lab ``DFlashDraftModel`` that SGLang and vLLM serve:
``fc`` projects the concatenated target layer outputs to the hidden size, ``hidden_norm``
normalises the result (the "context"), and every layer attends from the block tokens to
``cat(context, block)`` keys/values made with the same projections. The drafter has no
embedding and no LM head: the caller embeds block tokens with the target's ``embed_tokens``
and turns the returned hidden states into logits with the target's ``lm_head``.

This module is pure: torch and transformers layers, no file I/O of its own (loading and
saving go through ``PreTrainedModel``), no accelerate, wandb or Hydra.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)
from transformers import initialization as hf_init

from .dflash2 import DFLASH2_KEYS, CandidateSelector, GroupedDynamicConv, identity_kernel  # relative: exports copy both

try:  # flex attention is used for packed training on CUDA; absent on very old torch
    from torch.nn.attention.flex_attention import BlockMask, flex_attention
except ImportError:  # pragma: no cover
    BlockMask, flex_attention = None, None

log = logging.getLogger(__name__)

_compiled_flex = None
_flex_shapes: set = set()


def flex_compile_count() -> int:
    """Distinct flex attention graphs compiled in this process so far (one per input shape and mask
    kind: flex is compiled with static shapes, so draft_packed pads shapes into buckets to bound this)."""
    return len(_flex_shapes)


def _flex(q, k, v, block_mask, scale):
    """flex_attention compiled once per process (uncompiled flex is a slow reference path that
    materialises the whole score matrix). Each new shape compiles a new graph; the recompile limit is
    raised as needed so torch never falls back to the uncompiled path."""
    global _compiled_flex
    if torch.compiler.is_compiling():  # inside a compiled layer (train.compile=layers): compiled with the layer
        return flex_attention(*_autocast_qkv(q, k, v), block_mask=block_mask, scale=scale, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    key = (tuple(q.shape), tuple(k.shape), q.dtype, q.requires_grad or k.requires_grad,
           getattr(block_mask.mask_mod, "window", None), getattr(block_mask.mask_mod, "causal", None))
    if key not in _flex_shapes:
        _flex_shapes.add(key)
        config = torch._dynamo.config
        limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
        if getattr(config, limit) < len(_flex_shapes) + 1:
            setattr(config, limit, 2 * len(_flex_shapes))
        log.info("flex attention: compiling for queries %s, keys %s (%d graphs so far)", tuple(q.shape),
                 tuple(k.shape), len(_flex_shapes))
    return _compiled_flex(*_autocast_qkv(q, k, v), block_mask=block_mask, scale=scale, enable_gqa=True)


def _autocast_qkv(q, k, v):
    """Autocast skips flex (it does cast sdpa): q/k leave the float32-weighted norms in float32, v is in bf16."""
    if torch.is_autocast_enabled(q.device.type):
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    return q, k, v


@dataclass
class ContextCache:
    """Projected context keys/values per drafter layer, kept across decoding steps.

    Context keys depend only on the target features and the layer's weights (never on block
    tokens), so caching them is exact. Shapes: keys/values [b, kv_heads, ctx, head_dim],
    positions [b, ctx].
    """

    keys: list[torch.Tensor | None] = field(default_factory=list)
    values: list[torch.Tensor | None] = field(default_factory=list)
    positions: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return 0 if self.positions is None else self.positions.shape[1]


SLIDING_RULE = "causal_window"
"""How sliding_attention layers attend, recorded in config.json as `dflash_sliding_attention` (a key
serving frameworks ignore): by default causal inside the block, a window of W keys ending at the query,
over context and block positions together (flash attention causal=True, window=(W-1, 0)), as SGLang and
vLLM serve DFlash drafters (DESIGN §2); non-causal where the config says so (`attention_rules`). dflash
before this rule attended both ways inside the block, with no window inside it."""


class AttentionRule(NamedTuple):
    """What a drafter layer's block queries see besides the context before the anchor and their own block
    (DESIGN §2). causal: only keys at positions <= the query's. window W: only keys within W positions of the
    query, q-(W-1) .. q when causal (flash attention window (W-1, 0)), |q - k| < W when not ((W-1, W-1): vLLM
    widens the window both ways for a non-causal layer; the z-lab reference masks |q - k| < W)."""

    causal: bool
    window: int | None


FULL = AttentionRule(False, None)
"""DFlash's full_attention layer: the whole block both ways, all the context before the anchor."""


def attention_rules(config) -> list[AttentionRule]:
    """Each drafter layer's rule, read from config.json as vLLM reads it, and refused where the servers (vLLM,
    SGLang, the z-lab reference) would read it differently from one another.

    causal: top-level `is_causal` (every layer), else `dflash_config.causal` (every layer), else the layer type
    (sliding_attention causal, full_attention not). Windowed: the sliding_attention layers of `layer_types`
    (with `dflash_config.use_swa` and no layer_types: every layer); the window is `dflash_config.swa_window_size`,
    else `sliding_window`.
    """
    dflash = getattr(config, "dflash_config", None) or {}
    n = config.num_hidden_layers
    types = getattr(config, "layer_types", None)
    top, inner = getattr(config, "is_causal", None), dflash.get("causal")
    use_swa, swa = dflash.get("use_swa"), dflash.get("swa_window_size")
    window = swa if swa is not None else getattr(config, "sliding_window", None)
    if top is not None and inner is not None and bool(top) != bool(inner):
        raise ValueError(f"is_causal={top} and dflash_config.causal={inner} disagree (vLLM takes is_causal, SGLang "
                         f"and the z-lab reference read only is_causal): make them equal")
    if top is None and inner is not None and (types is None or any(
            bool(inner) != (t == "sliding_attention") for t in types)):
        raise ValueError(f"dflash_config.causal={inner} without is_causal: vLLM applies it to every layer, SGLang and "
                         f"the z-lab reference ignore it (they decide by layer type); set is_causal={inner} too")
    if types is None:
        if use_swa or top:
            raise ValueError("a drafter config without layer_types and with dflash_config.use_swa or is_causal=true: "
                             "vLLM windows/masks every layer, SGLang none; give layer_types explicitly")
        types = ["full_attention"] * n
    elif use_swa and "sliding_attention" not in types:
        raise ValueError("dflash_config.use_swa=true but no layer is sliding_attention: vLLM then windows every layer, "
                         "SGLang and the z-lab reference none; list the sliding layers in layer_types")
    sliding = [t == "sliding_attention" for t in types]
    if any(sliding) and swa is not None and getattr(config, "sliding_window", None) != swa:
        raise ValueError(f"dflash_config.swa_window_size={swa} but sliding_window={config.sliding_window}: vLLM "
                         f"takes the first, SGLang and the z-lab reference the second; make them equal")
    causal = [bool(top if top is not None else inner) if (top, inner) != (None, None) else s for s in sliding]
    return [AttentionRule(c, int(window) if s and window is not None else None) for c, s in zip(causal, sliding)]


def attention_keys(rules: list[AttentionRule]) -> dict:
    """The attention keys an export writes, so that every server reads `rules` back (attention_rules): is_causal
    and dflash_config.causal when all layers agree (a mix of causal sliding and non-causal full layers is the
    layer-type default, which every server reads alike), use_swa and swa_window_size."""
    causal = {r.causal for r in rules}
    windows = {r.window for r in rules if r.window is not None}
    keys = {"dflash_config": {"use_swa": bool(windows)}}
    if windows:
        keys["dflash_config"]["swa_window_size"] = windows.pop()
    if len(causal) == 1:
        keys["is_causal"] = keys["dflash_config"]["causal"] = causal.pop()
    return keys


def rule_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, rule: AttentionRule) -> torch.Tensor:
    """[b, 1, q, k] bool of one block's queries at q_pos [b, q] over keys at k_pos [b, k] (context keys all lie
    before the anchor, so only the rule itself hides any)."""
    dist = q_pos[:, :, None] - k_pos[:, None, :]
    visible = torch.ones_like(dist, dtype=torch.bool)
    if rule.causal:
        visible &= dist >= 0
    if rule.window is not None:
        visible &= (dist < rule.window) & (dist > -rule.window)
    return visible[:, None]


def sliding_window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """[b, 1, q, k] bool: the keys at positions q-(window-1) .. q of each query at position q."""
    return rule_mask(q_pos, k_pos, AttentionRule(True, window))


def check_sliding_window(config: Qwen3Config) -> None:
    """Refuse sliding_attention layers without a window: packed masks would make them full attention in
    training and evaluation, and live decoding would fail. Qwen3Config nulls `sliding_window` whenever
    `use_sliding_window` is false, so a config.json can hold a window and still lose it."""
    types = getattr(config, "layer_types", None) or []
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and getattr(config, "sliding_window", None) is None:
        raise ValueError(
            f"drafter layers {sliding} are sliding_attention but sliding_window is null (transformers sets it "
            f"to null when use_sliding_window is false): set sliding_window to the window size and "
            f"use_sliding_window to true (drafter.sliding_window, or config.json), or make those layers "
            f"full_attention in layer_types")


class DFlashAttention(nn.Module):
    """Queries from the block; keys/values from cat(context, block), one set of projections."""

    def __init__(self, config: Qwen3Config, layer_idx: int, rule: AttentionRule = FULL):
        super().__init__()
        self.layer_idx = layer_idx
        self.rule = rule
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        self.layer_type = layer_types[layer_idx]
        self.sliding_window = rule.window

    def forward(self, hidden, context, cos, sin, mask, cache: ContextCache | None):
        """hidden [b, q, H] (block), context [b, c, H] (new context) -> [b, q, H].

        cos/sin: [b, c + q, head_dim] for the new context then the block.
        mask: None (every key visible), a bool tensor [b, 1, q, keys], a flex BlockMask, or a
            chunked dense mask (dflash.drafter.packed_attention.ChunkedMask) for packed blocks.
        """
        b, q_len, _ = hidden.shape
        c_len = context.shape[1]
        q = self.q_norm(self.q_proj(hidden).view(b, q_len, self.num_heads, self.head_dim)).transpose(1, 2)
        kv_in = torch.cat([context, hidden], dim=1)
        k = self.k_norm(self.k_proj(kv_in).view(b, c_len + q_len, self.num_kv_heads, self.head_dim))
        k = k.transpose(1, 2)
        v = self.v_proj(kv_in).view(b, c_len + q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos[:, :, -q_len:] + rotate_half(q) * sin[:, :, -q_len:]
        k = k * cos + rotate_half(k) * sin
        if cache is not None:
            if cache.keys[self.layer_idx] is not None:
                k = torch.cat([cache.keys[self.layer_idx], k], dim=2)
                v = torch.cat([cache.values[self.layer_idx], v], dim=2)
            cache.keys[self.layer_idx] = k[:, :, : k.shape[2] - q_len]
            cache.values[self.layer_idx] = v[:, :, : v.shape[2] - q_len]
        if BlockMask is not None and isinstance(mask, BlockMask):
            out = _flex(q, k, v, mask, self.scaling)
        elif hasattr(mask, "attend"):  # packed blocks, dense path: the mask brings its attention (training only)
            out = mask.attend(q, k, v, self.scaling)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, -1))


class DFlashDecoderLayer(nn.Module):
    """A Qwen3 decoder layer with KV injection; DFlash 2 wraps both sublayers in a grouped dynamic
    convolution (dflash.drafter.dflash2), inside the residual branch after the norm."""

    def __init__(self, config: Qwen3Config, layer_idx: int, rule: AttentionRule = FULL):
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx, rule)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = block_size_of(config)
        if is_dflash2(config):
            k, group = int(dflash_value(config, "conv_kernel_size")), int(dflash_value(config, "conv_group_size"))
            self.attention_conv = GroupedDynamicConv(config.hidden_size, k, group)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, k, group)
        else:
            self.attention_conv = self.mlp_conv = None

    def forward(self, hidden, context, cos, sin, mask, cache):
        x = self.input_layernorm(hidden)
        if self.attention_conv is None:
            hidden = hidden + self.self_attn(x, context, cos, sin, mask, cache)
            return hidden + self.mlp(self.post_attention_layernorm(hidden))
        B = self.block_size  # the taps stop at each block's first slot (packed blocks are B queries each)
        x, taps = self.attention_conv.prepare(x, B)
        hidden = hidden + self.attention_conv.finish(self.self_attn(x, context, cos, sin, mask, cache), taps, B)
        x, taps = self.mlp_conv.prepare(self.post_attention_layernorm(hidden), B)
        return hidden + self.mlp_conv.finish(self.mlp(x), taps, B)


def dflash_value(config, name: str, default=None):
    """A drafter key as the servers read it: `dflash_config` first, then the top level."""
    dflash = getattr(config, "dflash_config", None) or {}
    return dflash[name] if name in dflash else getattr(config, name, default)


SCALE_KEYS = ("input_embedding_scale", "output_multiplier", "final_logit_softcapping")
"""The keys (dflash_config first, then the top level, as the servers and the z-lab reference read them) that say
how the target scales what the drafter borrows from it: its embeddings in, its logits out (`Scales`)."""


class Scales(NamedTuple):
    """How the drafter uses the target's embedding table and head, as the target itself does (Gemma scales its
    embeddings by sqrt(hidden) and caps its logits; Granite and Cohere scale theirs): block tokens are
    `embedding[ids] * input_embedding_scale`; logits are `head(h) * output_multiplier`, then, with a softcap c,
    `c * tanh(logits / c)` (the order of the z-lab reference's compute_logits). The identity for Qwen and Llama."""

    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def embed(self, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """[.., H] rows of the target's embedding table `weight` [V, H] for `ids`, scaled as the target scales them."""
        rows = F.embedding(ids, weight)
        return rows if self.input_embedding_scale == 1.0 else rows * self.input_embedding_scale

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """float32 logits [.., V] of drafter hidden states [.., H] through the target head `head_weight` [V, H]. The
        rows go through as one 2-D matmul: on CPU a linear of a non-contiguous 3-D input (a block's slots 1.., say)
        becomes a bmm over a copy of the head per leading row (63 x 576 x 49152 for a 49k vocabulary: 10 s of a
        14 s evaluation of 4 prompts)."""
        rows = hidden.reshape(-1, hidden.shape[-1]).to(head_weight.dtype)
        return self.finish(F.linear(rows, head_weight).float().view(*hidden.shape[:-1], -1))

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """The drafter's logits from the target head's raw output `logits` [.., V]."""
        if self.output_multiplier != 1.0:
            logits = logits * self.output_multiplier
        cap = self.final_logit_softcapping
        return logits if not cap else torch.tanh(logits / cap) * cap

    def keys(self) -> dict:
        """The entries an export writes for the servers, in dflash_config and at the top level (readers take one
        or the other): those that are not the identity."""
        return {k: v for k, v in self._asdict().items() if v != Scales._field_defaults[k]}


def scales_of(config) -> Scales:
    """A drafter config's Scales (a softcap of null or <= 0 is none, as the reference reads it)."""
    cap = dflash_value(config, "final_logit_softcapping")
    return Scales(float(dflash_value(config, "input_embedding_scale", 1.0) or 1.0),
                  float(dflash_value(config, "output_multiplier", 1.0) or 1.0),
                  float(cap) if cap is not None and float(cap) > 0 else None)


def is_dflash2(config) -> bool:
    """A DFlash 2 config: its architecture says so, or it carries the convolution and selector keys."""
    return "DFlash2DraftModel" in (getattr(config, "architectures", None) or []) or all(
        dflash_value(config, k) is not None for k in DFLASH2_KEYS)


def block_size_of(config) -> int:
    """The block size as the z-lab reference reads it: `dflash_config.block_size`, then the top level, else 16. A
    config.json whose two disagree is refused: which one a server reads is its own choice, and a drafter trained
    at one size and served at the other loses its acceptance without an error."""
    dflash = getattr(config, "dflash_config", None) or {}
    top = getattr(config, "block_size", None)
    if dflash.get("block_size") is not None and top is not None and int(dflash["block_size"]) != int(top):
        raise ValueError(f"drafter config.json says dflash_config.block_size={dflash['block_size']} and "
                         f"block_size={top}; set both to the block size the drafter was trained with")
    return int(dflash_value(config, "block_size", 16))


class DFlashDraftModel(Qwen3PreTrainedModel):
    """DFlash drafter in the z-lab layout (the class name is what serving frameworks expect).

    Config: a Qwen3Config with `block_size`, `num_target_layers`, `layer_types`,
    `sliding_window` and `dflash_config = {target_layer_ids, mask_token_id}`.
    """

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    _keys_to_ignore_on_load_unexpected = [r"rotary_emb\.inv_freq"]

    def __init__(self, config: Qwen3Config):
        super().__init__(config)
        dflash = getattr(config, "dflash_config", None) or {}
        if "target_layer_ids" not in dflash or "mask_token_id" not in dflash:
            raise ValueError("drafter config.json needs dflash_config.target_layer_ids and "
                             "dflash_config.mask_token_id")
        check_sliding_window(config)
        self.target_layer_ids = list(dflash["target_layer_ids"])
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = block_size_of(config)
        self.scales = scales_of(config)
        if is_dflash2(config):
            missing = [k for k in DFLASH2_KEYS if dflash_value(config, k) is None]
            if missing:
                raise ValueError(f"a DFlash2DraftModel config.json needs dflash_config.{', '.join(missing)}")
        rules = attention_rules(config)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i, rules[i]) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, int(dflash_value(config, "selector_rank")),
            int(dflash_value(config, "selector_top_k"))) if is_dflash2(config) else None
        self.gradient_checkpointing = False
        # torch.utils.checkpoint's context_fn for the layers: training's selective checkpointing sets its own
        # (dflash.drafter.recompute); the default recomputes everything
        self.checkpoint_contexts = noop_context_fn
        self.post_init()

    @property
    def kind(self) -> str:
        """dflash or dflash2 (`drafter.kind`)."""
        return "dflash" if self.candidate_selector is None else "dflash2"

    def _init_weights(self, module) -> None:
        """transformers' init, then DFlash 2's: identity convolutions (a fresh DFlash 2 drafter computes what
        the DFlash one does) and codebooks at the initializer range. Through transformers' guarded init, so
        weights loaded from a checkpoint are never overwritten."""
        super()._init_weights(module)
        if isinstance(module, GroupedDynamicConv):
            hf_init.copy_(module.base_kernel, identity_kernel(module.kernel_size, module.base_kernel.shape[-1]))
            hf_init.zeros_(module.kernel_projection.weight)
        elif isinstance(module, CandidateSelector):
            std = getattr(self.config, "initializer_range", 0.02) or 0.02
            hf_init.normal_(module.predecessor_codebook, mean=0.0, std=std)
            hf_init.normal_(module.successor_codebook, mean=0.0, std=std)

    def _set_gradient_checkpointing(self, enable: bool = True, *_, **__) -> None:
        """What transformers' `gradient_checkpointing_enable()` calls (train.gradient_checkpointing): in
        training, each layer keeps only its inputs and recomputes its activations in backward."""
        self.gradient_checkpointing = enable

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        """Load strictly: a missing, unexpected or misshapen weight is an error, never a fresh init."""
        kwargs["output_loading_info"] = True
        model, info = super().from_pretrained(path, *args, **kwargs)
        problems = {
            "missing": sorted(info.get("missing_keys", [])),
            "unexpected": sorted(k for k in info.get("unexpected_keys", []) if "rotary_emb" not in k),
            "mismatched": sorted(str(k) for k in info.get("mismatched_keys", [])),
            "errors": list(info.get("error_msgs", [])),
        }
        problems = {k: v for k, v in problems.items() if v}
        if problems:
            raise ValueError(f"drafter weights in {path} do not match its config.json: {problems}; "
                             f"the checkpoint is incomplete or from another drafter shape")
        return model

    def get_input_embeddings(self) -> None:
        """None: block tokens are embedded with the target's embed_tokens (transformers' default raises here,
        and accelerate's FSDP2 asks for the input embeddings to shard them apart)."""
        return None

    @property
    def layer_types(self) -> list[str]:
        return [layer.self_attn.layer_type for layer in self.layers]

    @property
    def attention_rules(self) -> list[AttentionRule]:
        """Each layer's AttentionRule (causal, window), as the servers read this config (`attention_rules`)."""
        return [layer.self_attn.rule for layer in self.layers]

    def new_cache(self) -> ContextCache:
        n = len(self.layers)
        return ContextCache(keys=[None] * n, values=[None] * n)

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """[b, c, n_layers * H] target features -> [b, c, H] context."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        noise_embedding: torch.Tensor,
        target_hidden: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask=None,
        cache: ContextCache | None = None,
    ) -> torch.Tensor:
        """Draft hidden states for one or many blocks.

        noise_embedding: [b, q, H] target embeddings of the block tokens [x_p, M, ..., M]
            (`self.scales.embed(embed_tokens.weight, ids)`).
        target_hidden: [b, c, n_layers * H] features of the context positions (with a cache:
            only the positions not yet cached).
        position_ids: [b, c + q] positions of those context positions, then of the block.
        attention_mask: None (the block sees all context, which must lie strictly before the
            anchor; each layer's AttentionRule applied), a bool [b, 1, q, keys] tensor, a flex BlockMask, or
            a dict of either per AttentionRule (dflash.drafter.blocks.packed_attention_masks) for packed training.
        cache: context keys/values from earlier calls, extended in place.
        Returns the final-normed hidden states [b, q, H]: logits are `self.scales.logits(h, lm_head.weight)`.
        """
        context = self.project_context(target_hidden)
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        masks = self._masks(attention_mask, position_ids, noise_embedding.shape[1], cache)
        hidden = noise_embedding
        for layer in self.layers:
            mask = masks[layer.self_attn.rule]
            if self.training and cache is None:
                hidden = self.train_layer(layer, hidden, context, cos, sin, mask)
            else:
                hidden = layer(hidden, context, cos, sin, mask, cache)
        if cache is not None:
            new_pos = position_ids[:, : context.shape[1]]
            cache.positions = new_pos if cache.positions is None else torch.cat([cache.positions, new_pos], 1)
        return self.norm(hidden)

    def train_layer(self, layer, hidden, context, cos, sin, mask) -> torch.Tensor:
        """One layer in training, recomputed in backward with gradient checkpointing (`checkpoint_contexts` says
        what it keeps); train.compile=layers compiles it, checkpoint included (dflash.drafter.recompute)."""
        if self.gradient_checkpointing and torch.is_grad_enabled():
            # compared before it is passed: under compile dynamo takes a context_fn it has looked at, not one it
            # holds unread ("checkpoint not implemented for LazyVariableTracker")
            selective = {} if self.checkpoint_contexts is noop_context_fn else {"context_fn": self.checkpoint_contexts}
            return checkpoint(layer, hidden, context, cos, sin, mask, None, use_reentrant=False, **selective)
        return layer(hidden, context, cos, sin, mask, None)

    def _masks(self, attention_mask, position_ids, q_len, cache) -> dict:
        """A mask per attention rule: a dict given as is (packed blocks: dflash.drafter.blocks), one given mask for
        every rule, or for one block (None) each rule's own from the positions (the full rule needs none)."""
        if isinstance(attention_mask, dict):
            return attention_mask
        rules = set(self.attention_rules)
        if attention_mask is not None or rules == {FULL}:
            return {rule: attention_mask for rule in rules}
        k_pos = position_ids if cache is None or cache.positions is None else torch.cat(
            [cache.positions, position_ids], dim=1)
        return {rule: None if rule == FULL else rule_mask(position_ids[:, -q_len:], k_pos, rule) for rule in rules}


class DFlash2DraftModel(DFlashDraftModel):
    """The class name DFlash 2 exports carry (`architectures`, `auto_map`): the same model, which builds the
    convolutions and the selector from the DFlash 2 keys of its config."""


DFlashDrafter = DFlashDraftModel
"""The one public alias (README's `dflash.model.DFlashDrafter`); dflash itself says DFlashDraftModel."""
