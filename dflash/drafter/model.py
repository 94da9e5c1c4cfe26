"""The DFlash drafter: Qwen3-style decoder layers with target-feature KV injection.

Layout and weight names follow the z-lab ``DFlashDraftModel`` that SGLang and vLLM serve:
``fc`` projects the concatenated target layer outputs to the hidden size, ``hidden_norm``
normalises the result (the "context"), and every layer attends from the block tokens to
``cat(context, block)`` keys/values made with the same projections. The drafter has no
embedding and no LM head: the caller embeds block tokens with the target's ``embed_tokens``
and turns the returned hidden states into logits with the target's ``lm_head``. Each layer's
attention (its rule, masks, the context cache) is in dflash.drafter.attention; here are the layers, the
config readers and the model.

This module is pure: torch and transformers layers, no file I/O of its own (loading and
saving go through ``PreTrainedModel``), no accelerate, wandb or Hydra.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, noop_context_fn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding
from transformers import initialization as hf_init

# relative: exports copy all three files (dflash.drafter.build.save_drafter)
from .attention import (FULL, AttentionRule, ContextCache, DFlashAttention, attention_rules, check_sliding_window,
                        rule_mask)
from .dflash2 import DFLASH2_KEYS, CandidateSelector, GroupedDynamicConv, identity_kernel


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
