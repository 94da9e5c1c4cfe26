"""Built-in targets: tiny random-weight models for tests, and the trained toy target.

Each is written with `save_pretrained` into a directory and then loaded through the same
`from_pretrained` path as a real model, so tests exercise the real loading code.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

TINY_SEED = 1234


def tiny_qwen3_config(vocab_size: int):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )


def tiny_qwen3_sliding_config(vocab_size: int):
    """tiny_qwen3 with sliding-window layers (window 8) alternating with full-attention ones: prompts of a
    few dozen tokens run past the window, as long contexts do on a real sliding-window target."""
    config = tiny_qwen3_config(vocab_size)
    config.layer_types = ["sliding_attention", "full_attention"] * (config.num_hidden_layers // 2)
    config.sliding_window, config.use_sliding_window = 8, True
    return config


def tiny_qwen3_5_config(vocab_size: int):
    """Qwen3.5 text config: 3 Gated DeltaNet layers to 1 full-attention layer, 8 layers."""
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
    )


INSTALL_MARK = ".dflash-install"  # in a built-in target's folder: dflash wrote it, and may replace it


def default_dir(name: str) -> Path:
    """Where conf/target/<name>.yaml installs a built-in target: $DFLASH_HOME/targets/<name>."""
    return Path(os.environ.get("DFLASH_HOME", "~/.cache/dflash")).expanduser() / "targets" / name


def installed_by_dflash(name: str, dest: Path) -> bool:
    """Whether `dest` is dflash's own install of built-in target `name` (its mark, or for installs older
    than the mark, the default folder), rather than a build of someone's own at that path."""
    return (dest / INSTALL_MARK).exists() or dest.expanduser().resolve() == default_dir(name).resolve()


def is_current(name: str, dest: Path) -> bool:
    """Whether the built-in target installed in `dest` is the one this dflash would build: False for a
    toy target installed from an earlier shipped build (its toy_info.json differs from the shipped one)."""
    if not (dest / "config.json").exists():
        return False
    if name != "toy":
        return True
    from dflash.target.toy import SHIPPED

    shipped = SHIPPED / "toy_info.json"
    return not shipped.exists() or (
        (dest / "toy_info.json").exists() and (dest / "toy_info.json").read_bytes() == shipped.read_bytes())


def build(name: str, dest: Path) -> None:
    """Write target `name` (tiny_qwen3, tiny_qwen3_sliding, tiny_qwen3_5, toy) into the empty directory `dest`."""
    if name == "toy":
        from dflash.errors import NotFoundError
        from dflash.target.toy import SHIPPED, install_shipped

        if not install_shipped(dest):  # a build from scratch would be the first of its recorded stages only
            raise NotFoundError(
                f"the shipped toy target is missing ({SHIPPED / 'config.json'} does not exist): reinstall dflash "
                f"(pip install -e .), or rebuild it with `python -m dflash.target.toy build` through the stages "
                f"README lists, into target.path")
        return
    from transformers import AutoModelForCausalLM

    from dflash.target.tokenizer import build_tokenizer

    tokenizer = build_tokenizer()
    config = {"tiny_qwen3": tiny_qwen3_config, "tiny_qwen3_sliding": tiny_qwen3_sliding_config,
              "tiny_qwen3_5": tiny_qwen3_5_config}[name](len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)
