"""Drafters for the other target families: ours in the z-lab reference class (rope scaling and attention biases
copied from Llama and GPT-OSS targets), and the published z-lab Gemma 4 drafter's config.json.

published/zlab_gemma4_31b_dflash_config.json is z-lab/gemma-4-31B-it-DFlash's config.json as third-party code
quotes it (a loader's test constant; hidden_act, token ids and a few other keys are not in that copy). The hub
was not reachable from here: the copy was checked field by field against three other quotations.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash.drafter.build import load_drafter, save_drafter
from dflash.drafter.build import drafter_config
from dflash.drafter.attention import AttentionRule
from dflash.drafter.model import DFlashDraftModel, Scales
from dflash.target.builtin import TINY
from tests.drafter.test_model import inputs
from tests.zlab import reference

PUBLISHED = Path(__file__).parent / "published" / "zlab_gemma4_31b_dflash_config.json"


@pytest.mark.parametrize("family", ["tiny_llama", "tiny_gpt_oss", "tiny_gemma"])
def test_the_reference_class_computes_our_family_drafters_alike(tmp_path, family):
    target = TINY[family][0](300)
    torch.manual_seed(0)
    config = drafter_config(target, num_layers=2, block_size=8, target_layer_ids=[1, 2, 3], mask_token_id=299)
    model = DFlashDraftModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    save_drafter(model, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    rope = {"tiny_llama": "llama3", "tiny_gpt_oss": "yarn", "tiny_gemma": None}[family]
    assert (written["rope_scaling"] or {}).get("rope_type") == rope
    assert written["attention_bias"] is (family == "tiny_gpt_oss")
    theirs = reference().DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    # positions far past the yarn and llama3 originals (4096, 8192): there the scaling changes the rotation
    noise, feats, pos = inputs(ctx=11, q=8)
    pos = pos + 20_000
    with torch.no_grad():
        ours, out = model(noise, feats, pos), theirs(position_ids=pos, noise_embedding=noise, target_hidden=feats)
    assert (ours - out).abs().max() < 1e-4


def test_the_published_gemma_drafter_loads_with_the_servers_rules_and_scales(tmp_path):
    """Its config at its published values, the widths scaled down (hidden 5376 -> 64) so its weights are small:
    4 sliding layers causal inside the block with a window of 2048, then 1 full layer both ways; the softcap its
    top level states, unscaled embeddings (no input_embedding_scale), as the servers and the reference read it."""
    config = json.loads(PUBLISHED.read_text())
    assert config["hidden_size"] == 5376 and config["final_logit_softcapping"] == 30.0
    config.update(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=300)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = DFlashDraftModel(drafter_config_from(config)).state_dict()
    save_file({k: 0.02 * torch.randn(v.shape) for k, v in shapes.items()}, str(tmp_path / "model.safetensors"))
    drafter = load_drafter(str(tmp_path))
    assert drafter.attention_rules == [AttentionRule(True, 2048)] * 4 + [AttentionRule(False, None)]
    assert drafter.scales == Scales(1.0, 1.0, 30.0)
    assert drafter.block_size == 16 and drafter.mask_token_id == 4
    assert drafter.target_layer_ids == [1, 12, 23, 35, 46, 57]
    ref = reference()
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    rules = [(a.is_causal, a.sliding_window) for a in (layer.self_attn for layer in theirs.layers)]
    assert rules == [(True, 2048)] * 4 + [(False, None)]
    assert float(ref._draft_value(theirs.config, "final_logit_softcapping")) == 30.0
    assert float(ref._draft_value(theirs.config, "input_embedding_scale", 1.0)) == 1.0


def drafter_config_from(config: dict):
    from transformers import Qwen3Config

    return Qwen3Config(**config)
