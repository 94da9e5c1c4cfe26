"""Building, loading and exporting drafters: what a serving framework or another tool reads."""

import json
import os
import subprocess
import sys

import torch

from dflash.drafter.build import load_drafter, save_drafter
from tests.drafter.test_model import inputs, make_drafter

CLEAN_LOAD = """
import sys, torch
from transformers import AutoModel
model = AutoModel.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
assert type(model).__name__ == "DFlashDraftModel", type(model)
assert not any(name == "dflash" or name.startswith("dflash.") for name in sys.modules)
x = torch.load(sys.argv[2])
with torch.no_grad():
    torch.save(model(x["noise"], x["feats"], x["pos"]), sys.argv[3])
"""


def test_a_saved_drafter_builds_through_automodel_in_a_clean_process(tmp_path):
    model = make_drafter(["sliding_attention", "full_attention"], 6)
    save_drafter(model, tmp_path / "drafter")
    noise, feats, pos = inputs()
    torch.save({"noise": noise, "feats": feats, "pos": pos}, tmp_path / "in.pt")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", CLEAN_LOAD, str(tmp_path / "drafter"), str(tmp_path / "in.pt"),
                             str(tmp_path / "out.pt")], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        ours = model(noise, feats, pos)
    assert (torch.load(tmp_path / "out.pt") - ours).abs().max() < 1e-6
    config = json.loads((tmp_path / "drafter/config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "modeling_dflash.DFlashDraftModel"}


def test_config_holds_both_spellings_of_the_rope_and_dtype_keys(tmp_path):
    model = make_drafter()
    save_drafter(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())  # as a transformers-4-style reader sees it
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"] > 0
    assert config["rope_scaling"] is None and config["rope_parameters"]["rope_type"] == "default"
    assert config["torch_dtype"] == config["dtype"] == "float32"
    noise, feats, pos = inputs()
    with torch.no_grad():
        assert torch.equal(load_drafter(str(tmp_path))(noise, feats, pos), model(noise, feats, pos))


def test_a_fine_tune_of_a_published_drafter_is_stamped_with_the_served_sliding_rule(tmp_path, caplog):
    """A published drafter's config.json has no dflash_sliding_attention; the fine-tune trains with the served
    rule, so its checkpoints say so and load without the warning meant for drafters trained before the rule."""
    from types import SimpleNamespace

    from dflash.config import DrafterConfig, LayersConfig
    from dflash.drafter.build import build_drafter
    from dflash.drafter.attention import SLIDING_RULE

    published = tmp_path / "published"
    make_drafter(["sliding_attention", "full_attention"], 6).save_pretrained(published)
    config = json.loads((published / "config.json").read_text())
    del config["dflash_sliding_attention"]
    (published / "config.json").write_text(json.dumps(config))
    target = SimpleNamespace(hidden_size=64, num_layers=12, vocab_size=300)
    drafter = build_drafter(DrafterConfig(num_layers=2, block_size=8, init_from=str(published)), LayersConfig(num=3),
                            target)
    assert drafter.config.dflash_sliding_attention == SLIDING_RULE
    checkpoint = tmp_path / "checkpoints/step-000010"
    save_drafter(drafter, checkpoint)
    (checkpoint / "train_state").mkdir()
    (checkpoint / "train_state/manifest.json").write_text("{}")  # a checkpoint dflash trained
    with caplog.at_level("WARNING"):
        load_drafter(str(checkpoint))
    assert "before its sliding-attention layers followed the served rule" not in caplog.text


def test_drafter_layers_start_as_the_target_layers_named(tiny_family_targets):
    """drafter.init_layers: drafter layer i is target layer ids[i] (Llama: no q/k norms, which stay at ones), its final
    norm the target's; a drafter shaped otherwise than the target, or an id out of range, is refused in one line."""
    import pytest

    from dflash.config import DrafterConfig, LayersConfig
    from dflash.drafter.build import build_drafter
    from dflash.errors import ConfigError

    target = tiny_family_targets["tiny_llama"][0]
    drafter = build_drafter(DrafterConfig(num_layers=2, block_size=8, init_layers=[6, 7]), LayersConfig(num=3), target)
    for i, layer in enumerate((6, 7)):
        mine, theirs = drafter.layers[i], target.layers[layer]
        assert torch.equal(mine.mlp.gate_proj.weight, theirs.mlp.gate_proj.weight)
        assert torch.equal(mine.self_attn.k_proj.weight, theirs.self_attn.k_proj.weight)
        assert torch.equal(mine.post_attention_layernorm.weight, theirs.post_attention_layernorm.weight)
        assert torch.equal(mine.self_attn.q_norm.weight, torch.ones_like(mine.self_attn.q_norm.weight))
    assert torch.equal(drafter.norm.weight, target.final_norm.weight)
    fresh = build_drafter(DrafterConfig(num_layers=2, block_size=8), LayersConfig(num=3), target)
    assert not torch.equal(fresh.layers[0].mlp.gate_proj.weight, target.layers[6].mlp.gate_proj.weight)
    with pytest.raises(ConfigError, match="do not fit the drafter's"):
        build_drafter(DrafterConfig(num_layers=1, block_size=8, init_layers=[7], head_dim=32), LayersConfig(num=3),
                      target)
    with pytest.raises(ConfigError, match=r"\[8\] outside"):
        build_drafter(DrafterConfig(num_layers=1, block_size=8, init_layers=[8]), LayersConfig(num=3), target)
    with pytest.raises(ConfigError, match="one target layer id per drafter layer"):
        DrafterConfig(num_layers=2, init_layers=[7])
