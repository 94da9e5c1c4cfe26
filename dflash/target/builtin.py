"""Built-in targets: tiny random-weight models for tests, and the trained toy target.

Each is written with `save_pretrained` into a directory and then loaded through the same
`from_pretrained` path as a real model, so tests exercise the real loading code. A run builds
one into target.path on first use (`ensure_built`, called as the target's config is read).
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import time
from pathlib import Path

import torch

from dflash.config import TargetConfig
from dflash.errors import NotFoundError
from dflash.layout import home
from dflash.target.tokenizer import FAMILIES, build_tokenizer
from dflash.target.toy import SHIPPED, install_shipped

log = logging.getLogger(__name__)

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


def tiny_qwen3_hd32_config(vocab_size: int):
    """tiny_qwen3 at head width 32, the smallest vLLM's CPU attention takes (it has no kernel for 16): the
    target `make engines` serves through vLLM."""
    config = tiny_qwen3_config(vocab_size)
    config.head_dim = 32
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


def tiny_qwen3_moe_config(vocab_size: int):
    """Qwen3-MoE (as Qwen3-Coder-30B-A3B): every MLP a mixture of 4 experts, top-2 routed, the top-k weights
    renormalised (norm_topk_prob, as the 30B-A3B models set it)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
    )


def tiny_qwen3_5_moe_config(vocab_size: int):
    """Qwen3.5/3.6 MoE (as Qwen3.6-35B-A3B): the hybrid layout of tiny_qwen3_5, every MLP 4 experts top-2 and a
    shared expert."""
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(
        vocab_size=vocab_size, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, shared_expert_intermediate_size=32, max_position_embeddings=4096,
        tie_word_embeddings=False,
    )


def tiny_llama_config(vocab_size: int):
    """Llama 3.1: no q/k norms, llama3 rope scaling (factor 8 over 8192 original positions), as Llama-3.1-8B."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    )


def tiny_gemma_config(vocab_size: int):
    """Gemma 4 (as gemma-4-31B-it): embeddings scaled by sqrt(hidden) (8 here), tied head, logits soft-capped,
    5 sliding-window layers (window 8) to 1 full one with its own head width and keys shared as values
    (attention_k_eq_v), no per-layer embeddings. The cap is 1.0 (31B: 30.0) so that it bends this random
    model's logits, which stay within about +-1."""
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, global_head_dim=32, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=8, final_logit_softcapping=1.0, hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=vocab_size, max_position_embeddings=4096, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention", "full_attention"],
    )


def tiny_gpt_oss_config(vocab_size: int):
    """GPT-OSS: 4 experts top-2 in every layer, a learned attention sink per head, sliding-window layers (window
    8) alternating with full ones, yarn rope, biased attention projections."""
    from transformers import GptOssConfig

    return GptOssConfig(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=64, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )


TINY = {"tiny_qwen3": (tiny_qwen3_config, "qwen"), "tiny_qwen3_sliding": (tiny_qwen3_sliding_config, "qwen"),
        "tiny_qwen3_tools": (tiny_qwen3_config, "qwen_tools"),  # tiny_qwen3 whose template renders tools
        "tiny_qwen3_hd32": (tiny_qwen3_hd32_config, "qwen"),
        "tiny_qwen3_5": (tiny_qwen3_5_config, "qwen"), "tiny_qwen3_moe": (tiny_qwen3_moe_config, "qwen"),
        "tiny_qwen3_5_moe": (tiny_qwen3_5_moe_config, "qwen"),
        "tiny_llama": (tiny_llama_config, "llama3"), "tiny_gemma": (tiny_gemma_config, "gemma4"),
        "tiny_gpt_oss": (tiny_gpt_oss_config, "harmony")}
"""The tiny random-weight targets: (config builder, chat family of dflash.target.tokenizer.FAMILIES)."""


INSTALL_MARK = ".dflash-install"  # in a built-in target's folder: dflash wrote it, and may replace it


def default_dir(name: str) -> Path:
    """Where conf/target/<name>.yaml installs a built-in target: $DFLASH_HOME/targets/<name>."""
    return home() / "targets" / name


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

    shipped = SHIPPED / "toy_info.json"
    return not shipped.exists() or (
        (dest / "toy_info.json").exists() and (dest / "toy_info.json").read_bytes() == shipped.read_bytes())


def build(name: str, dest: Path) -> None:
    """Write target `name` (toy, or one of TINY) into the empty directory `dest`."""
    if name == "toy":
        if not install_shipped(dest):  # a build from scratch would be the first of its recorded stages only
            raise NotFoundError(
                f"the shipped toy target is missing ({SHIPPED / 'config.json'} does not exist): reinstall dflash "
                f"(pip install -e .), or rebuild it with `python -m dflash.target.toy build` through the stages "
                f"docs/results/2026-12-02-toy-target.md lists, into target.path")
        return
    from transformers import AutoModelForCausalLM

    make_config, family = TINY[name]
    tokenizer = build_tokenizer(family=family)
    config = make_config(len(tokenizer))
    config.eos_token_id = tokenizer.eos_token_id
    config.pad_token_id = tokenizer.pad_token_id
    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stops = FAMILIES[family].stops  # Qwen's: the tokenizer's eos alone, as the tiny Qwen targets always had
    model.generation_config.eos_token_id = (tokenizer.convert_tokens_to_ids(list(stops)) if stops
                                            else tokenizer.eos_token_id)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(dest)
    tokenizer.save_pretrained(dest)


def ensure_built(cfg: TargetConfig) -> None:
    """Build a built-in target into cfg.path on first use (atomically; concurrent builders are fine).
    A toy target installed by an earlier dflash, whose shipped toy target has changed since, is replaced;
    a toy target built by someone at their own path (`python -m dflash.target.toy build --out DIR`,
    then target.path=DIR) is theirs: used as it is, never replaced."""
    dest = Path(cfg.path).expanduser()
    if cfg.build is None or is_current(cfg.build, dest):
        return
    if (dest / "config.json").exists() and not installed_by_dflash(cfg.build, dest):
        _warn_own_build(dest, cfg.build)
        return
    if _distributed_rank() != 0:  # transformers' save_pretrained writes on rank 0 only: rank 0 builds it
        _wait_for_build(dest, cfg.build)
        return
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    if (dest / "config.json").exists():
        log.warning("%s holds an earlier build of target %s than this dflash ships; replacing it (feature "
                    "caches are keyed by the target, so none made with the old one is reused)", dest, cfg.build)
    else:
        log.info("building target %s into %s", cfg.build, dest)
    try:
        build(cfg.build, tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / INSTALL_MARK).write_text(f"installed by dflash as target {cfg.build}; replaced when dflash ships "
                                    f"another build of it\n")
    aside = None
    if dest.exists():  # the earlier build: set aside, then removed once the new one is in place
        aside = Path(tempfile.mkdtemp(prefix=f".{dest.name}-old-", dir=dest.parent))
        try:
            dest.rename(aside / dest.name)
        except OSError:  # another process moved it first
            pass
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first; theirs is identical
        shutil.rmtree(tmp, ignore_errors=True)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)


@functools.lru_cache(maxsize=None)
def _warn_own_build(dest: Path, name: str) -> None:
    """Once per folder and process (a run loads the target more than once)."""
    log.warning("target.path=%s holds a model dflash did not install: target.build=%s applies to dflash's own "
                "folders only, so it is loaded as it is (set target.build=null to say so)", dest, name)


def _distributed_rank() -> int:
    import torch.distributed as td

    return td.get_rank() if td.is_available() and td.is_initialized() else 0


BUILD_WAIT_S = 1800


def _wait_for_build(dest: Path, name: str) -> None:
    deadline = time.time() + BUILD_WAIT_S
    while not is_current(name, dest):
        if time.time() > deadline:
            raise NotFoundError(f"waited {BUILD_WAIT_S} s for process 0 to build the target into {dest}; check "
                                f"its log, or build it once before launching (one process: python train.py "
                                f"train.max_steps=1 with the same target)")
        time.sleep(1)
