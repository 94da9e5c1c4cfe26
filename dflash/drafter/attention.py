"""The DFlash drafter's attention: each layer's rule (causal, window) as config.json states it and the servers
read it, the masks the rules make, the context keys/values cached across decoding steps, and the attention layer
itself (queries from the block, keys/values from the context and the block, one set of projections), with flex
attention compiled once per shape for packed training.

Pure, as dflash.drafter.model is: torch and transformers layers only. Exports copy it beside the model file,
which imports it (relative).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, rotate_half

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
