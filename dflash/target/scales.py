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


def embedding_scale(module: nn.Module) -> float:
    """The factor an embedding module multiplies its rows by (transformers' *ScaledWordEmbedding keep it as the
    float `scalar_embed_scale` and the buffer `embed_scale`); 1.0 for a plain nn.Embedding."""
    scalar = getattr(module, "scalar_embed_scale", None)
    if scalar is not None:
        return float(scalar)
    buffer = getattr(module, "embed_scale", None)
    if isinstance(buffer, torch.Tensor) and buffer.device.type != "meta":
        return float(buffer)
    return 1.0 if buffer is None else float(buffer)


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
    if embedding is None:
        embedding = _meta_embedding(text_config)
    return {"input_embedding_scale": embedding_scale(embedding) if embedding is not None else 1.0,
            "output_multiplier": output_multiplier(text_config), "final_logit_softcapping": softcap(text_config)}


def _meta_embedding(text_config) -> nn.Module | None:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(text_config).get_input_embeddings()
    except Exception as e:  # a model class transformers cannot build from its config alone
        log.warning("cannot build %s on the meta device to read its embedding scale (%s: %s); taking 1.0. A "
                    "drafter checked against the whole target later (evaluation, live decoding) is refused if "
                    "the target does scale its embeddings",
                    type(text_config).__name__, type(e).__name__, str(e)[:120])
        return None
