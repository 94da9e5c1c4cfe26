"""How a target scales its embeddings in and its logits out, which a drafter borrowing its embedding table and
head must do alike (DESIGN §2b): Gemma multiplies the embeddings by sqrt(hidden) inside its embedding module and
caps its logits (`final_logit_softcapping`); Granite divides its logits by `logits_scaling`, Cohere multiplies
them by `logit_scale`. Read from the loaded model where there is one, else from its config (a meta-device build
for the embedding scale, which lives in the module, not in config.json)."""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

IDENTITY = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}


def embedding_scale(module: nn.Module) -> float | None:
    """The factor an embedding module multiplies its rows by (transformers' *ScaledWordEmbedding keep it as the
    float `scalar_embed_scale` and the buffer `embed_scale`); 1.0 for a plain nn.Embedding; None where it is only
    a buffer on the meta device (no value to read)."""
    scalar = getattr(module, "scalar_embed_scale", None)
    if scalar is not None:
        return float(scalar)
    buffer = getattr(module, "embed_scale", None)
    if buffer is None:
        return 1.0
    return None if isinstance(buffer, torch.Tensor) and buffer.is_meta else float(buffer)


def output_multiplier(text_config) -> float:
    """What the target multiplies its head's output by before any softcap."""
    if getattr(text_config, "output_multiplier", None) is not None:
        return float(text_config.output_multiplier)
    if getattr(text_config, "logit_scale", None) is not None:  # Cohere: logits * logit_scale
        return float(text_config.logit_scale)
    if getattr(text_config, "logits_scaling", None) is not None:  # Granite: logits / logits_scaling
        return 1.0 / float(text_config.logits_scaling)
    return 1.0


def softcap(text_config) -> float | None:
    cap = getattr(text_config, "final_logit_softcapping", None)
    return float(cap) if cap is not None and float(cap) > 0 else None


def target_scales(text_config, embedding: nn.Module | None = None) -> dict:
    """{input_embedding_scale, output_multiplier, final_logit_softcapping} of a target: the embedding scale from
    its loaded embedding module, else from a build of the model on the meta device (no weights, no memory)."""
    scale = embedding_scale(embedding if embedding is not None else _meta_embedding(text_config))
    if scale is None:
        log.warning("the embedding module of %s keeps its scale only as a buffer, unreadable on the meta device; "
                    "taking 1.0 (a drafter built from this load embeds unscaled rows). Load the whole target to read "
                    "it", type(text_config).__name__)
        scale = 1.0
    return {"input_embedding_scale": scale, "output_multiplier": output_multiplier(text_config),
            "final_logit_softcapping": softcap(text_config)}


def _meta_embedding(text_config) -> nn.Module:
    """The model's embedding module, built on the meta device (nn.Embedding where transformers cannot build it from
    its config alone: then the scale is taken as 1.0, and said so)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(text_config).get_input_embeddings()
    except Exception as e:  # a model class transformers cannot build from its config alone
        log.warning("cannot build %s on the meta device to read its embedding scale (%s: %s); taking 1.0 (a drafter "
                    "built from this load embeds unscaled rows; check_fits warns when it meets the whole target "
                    "and that scales them)", type(text_config).__name__, type(e).__name__, str(e)[:120])
        return nn.Embedding(1, 1, device="meta")
