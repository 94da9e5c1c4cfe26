"""A target's safetensors files read directly, without building its model: the heads a drafter borrows
(embed_tokens and lm_head, tied or not: all that offline training loads) and how many weight values the files
store (from their headers alone).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from dflash.errors import TargetError
from dflash.io import read_json
from dflash.target.quantization import check_heads


def weights_elements(model_dir: Path) -> int:
    """The number of stored weight values in a folder's safetensors files, from their headers alone."""
    import json
    import math

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with f.open("rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        total += sum(math.prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    return total


def load_heads(model_dir: Path, text_config, dtype: torch.dtype, device: torch.device):
    """embed_tokens and lm_head straight from the safetensors files (tied heads share one tensor); a head stored
    quantized is refused (dflash.target.quantization.check_heads)."""
    from safetensors import safe_open

    check_heads(model_dir)
    found: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():
                if name.startswith(("mtp.", "model.visual.", "visual.")):
                    continue
                for kind, suffix in (("embed", "embed_tokens.weight"), ("head", "lm_head.weight")):
                    if name.endswith(suffix) and kind not in found:
                        found[kind] = fh.get_tensor(name)
    if "embed" not in found:
        raise ValueError(f"no embed_tokens weight found in {model_dir}/*.safetensors")
    if "head" not in found and not _tied_heads(model_dir, text_config):
        # only a tied checkpoint leaves lm_head out; reusing embed_tokens here would train on the wrong logits
        raise TargetError(f"{model_dir} is not tied (tie_word_embeddings false) but its *.safetensors hold no "
                          f"lm_head.weight tensor; the checkpoint is incomplete: download it again, or set "
                          f"tie_word_embeddings true in its config.json if its head really is embed_tokens")
    head_w = found.get("head", found["embed"])
    embed = nn.Embedding.from_pretrained(found["embed"].to(dtype), freeze=True).to(device)
    head = nn.Linear(text_config.hidden_size, head_w.shape[0], bias=False, dtype=dtype)
    head.weight = nn.Parameter(head_w.to(dtype), requires_grad=False)
    return embed, head.to(device)


def _tied_heads(model_dir: Path, text_config) -> bool:
    """Whether the checkpoint ties lm_head to embed_tokens: its text config says so, or (a composite such as
    Qwen3_5ForConditionalGeneration, whose top-level flag is the one transformers ties by) its config.json."""
    top = model_dir / "config.json"
    return bool(getattr(text_config, "tie_word_embeddings", False)
                or (top.exists() and read_json(top).get("tie_word_embeddings", False)))
