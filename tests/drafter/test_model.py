"""The drafter: z-lab layout, exact save/load, agreement with an independent reference."""

import json
import math
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash.drafter.build import load_drafter
from dflash.drafter.build import drafter_config
from dflash.drafter.model import DFlashDraftModel
from dflash.errors import CheckpointError

TARGET = Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=12,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16)

ZLAB_KEYS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}" for i in range(2) for name in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
        "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight")}


def make_drafter(layer_types=None, window=None, seed=0):
    torch.manual_seed(seed)
    cfg = drafter_config(TARGET, num_layers=2, block_size=8, target_layer_ids=[1, 5, 9], mask_token_id=299,
                         layer_types=layer_types, sliding_window=window)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():  # norms start at 1; perturb them so a wrong norm cannot hide
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def inputs(ctx=11, q=8, seed=1):
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(2, q, 64, generator=g)
    feats = torch.randn(2, ctx, 3 * 64, generator=g)
    pos = torch.arange(ctx + q).expand(2, -1)
    return noise, feats, pos


def reference_forward(sd: dict, cfg: dict, noise, feats, pos):
    """DESIGN §2 written out with plain tensor math, independently of dflash.model."""
    eps, d = cfg["rms_norm_eps"], cfg["head_dim"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg["rope_theta"]

    def rms(x, w):
        return w * (x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, p):  # x [n, heads, d], p [n]
        inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
        ang = p[:, None].float() * inv
        cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
        rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * cos + rot * sin

    outs = []
    for b in range(noise.shape[0]):
        ctx = rms(feats[b] @ sd["fc.weight"].T, sd["hidden_norm.weight"])
        h = noise[b]
        q_len, c_len = h.shape[0], ctx.shape[0]
        for i in range(cfg["num_hidden_layers"]):
            p = lambda n: sd[f"layers.{i}.{n}.weight"]  # noqa: E731
            x = rms(h, p("input_layernorm"))
            kv_in = torch.cat([ctx, x])
            q = rms((x @ p("self_attn.q_proj").T).view(q_len, nh, d), p("self_attn.q_norm"))
            k = rms((kv_in @ p("self_attn.k_proj").T).view(c_len + q_len, nkv, d), p("self_attn.k_norm"))
            v = (kv_in @ p("self_attn.v_proj").T).view(c_len + q_len, nkv, d)
            q, k = rope(q, pos[b, c_len:]), rope(k, pos[b])
            heads = []
            for hh in range(nh):
                kvh = hh // (nh // nkv)
                scores = q[:, hh] @ k[:, kvh].T / math.sqrt(d)
                if cfg["layer_types"][i] == "sliding_attention":  # the served rule: causal, W keys up to q
                    dist = pos[b, c_len:, None] - pos[b, None, :]
                    scores = scores.masked_fill((dist < 0) | (dist >= cfg["sliding_window"]), float("-inf"))
                heads.append(torch.softmax(scores, -1) @ v[:, kvh])
            h = h + torch.cat(heads, -1) @ p("self_attn.o_proj").T
            x = rms(h, p("post_attention_layernorm"))
            gate = x @ p("mlp.gate_proj").T
            h = h + ((gate * torch.sigmoid(gate)) * (x @ p("mlp.up_proj").T)) @ p("mlp.down_proj").T
        outs.append(rms(h, sd["norm.weight"]))
    return torch.stack(outs)


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 6)])
def test_matches_independent_reference(layer_types, window):
    model = make_drafter(layer_types, window)
    noise, feats, pos = inputs()
    with torch.no_grad():
        ours = model(noise, feats, pos)
    ref = reference_forward(model.state_dict(), model.config.to_dict(), noise, feats, pos)
    assert (ours - ref).abs().max() < 1e-5


def test_save_load_round_trip_is_exact(tmp_path):
    model = make_drafter(["sliding_attention", "full_attention"], 6)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["model_type"] == "qwen3"
    # causal sliding + non-causal full layers: the layer-type default every server reads alike, said explicitly
    assert config["dflash_config"] == {"target_layer_ids": [1, 5, 9], "mask_token_id": 299, "use_swa": True,
                                       "swa_window_size": 6}
    assert "is_causal" not in config
    assert (config["block_size"], config["num_target_layers"], config["sliding_window"]) == (8, 12, 6)
    assert config["layer_types"] == ["sliding_attention", "full_attention"]
    assert set(load_file(tmp_path / "model.safetensors")) == ZLAB_KEYS
    loaded = load_drafter(str(tmp_path)).eval()
    for (n1, p1), (n2, p2) in zip(model.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    noise, feats, pos = inputs()
    with torch.no_grad():
        assert torch.equal(model(noise, feats, pos), loaded(noise, feats, pos))


def test_loads_a_published_layout_written_by_another_tool(tmp_path):
    """A config.json as z-lab publishes it (transformers 4.x fields) and bf16 weights written
    straight with safetensors: loads, and matches the reference on those weights."""
    cfg = {
        "architectures": ["DFlashDraftModel"], "attention_bias": False, "attention_dropout": 0.0,
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "block_size": 8, "bos_token_id": 1,
        "dflash_config": {"mask_token_id": 299, "target_layer_ids": [1, 5, 9]}, "eos_token_id": 2,
        "head_dim": 16, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
        "intermediate_size": 96, "layer_types": ["full_attention", "full_attention"],
        "max_position_embeddings": 40960, "max_window_layers": 2, "model_type": "qwen3",
        "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "num_target_layers": 12,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "transformers_version": "4.57.1",
        "use_cache": True, "use_sliding_window": False, "vocab_size": 300}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    g = torch.Generator().manual_seed(3)
    shapes = {k: v.shape for k, v in make_drafter().state_dict().items()}
    weights = {k: (1 + 0.1 * torch.randn(s, generator=g) if "norm" in k else 0.05 * torch.randn(s, generator=g))
               .to(torch.bfloat16) for k, s in shapes.items()}
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = load_drafter(str(tmp_path)).float().eval()
    assert model.target_layer_ids == [1, 5, 9] and model.mask_token_id == 299 and model.block_size == 8
    noise, feats, pos = inputs()
    with torch.no_grad():
        ours = model(noise, feats, pos)
    ref = reference_forward({k: v.float() for k, v in weights.items()}, cfg, noise, feats, pos)
    assert (ours - ref).abs().max() < 1e-5


def test_missing_weight_is_an_error_not_a_fresh_init(tmp_path):
    model = make_drafter()
    model.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="layers.1.mlp.up_proj.weight"):
        load_drafter(str(tmp_path))


def test_missing_files_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_drafter(str(tmp_path / "nope"))
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_drafter(str(tmp_path))


@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 5)])
def test_context_cache_equals_full_context(layer_types, window):
    """Feeding the context in pieces through the cache gives the same block outputs."""
    model = make_drafter(layer_types, window)
    noise, feats, _ = inputs(ctx=11)
    with torch.no_grad():
        full = model(noise, feats, torch.arange(19).expand(2, -1))
        cache = model.new_cache()
        model(noise, feats[:, :4], torch.cat([torch.arange(4), torch.arange(4, 12)]).expand(2, -1), cache=cache)
        part = model(noise, feats[:, 4:], torch.arange(4, 19).expand(2, -1), cache=cache)
    assert cache.length == 11
    assert (full - part).abs().max() < 1e-5



def _slot_outputs_after_changing_slot(model, j):
    noise, feats, pos = inputs()
    with torch.no_grad():
        before = model(noise, feats, pos)
        noise = noise.clone()
        noise[:, j] += 1.0
        return before, model(noise, feats, pos)


def test_sliding_layers_are_causal_inside_the_block_and_full_layers_are_not():
    """DESIGN §2, as SGLang and vLLM serve DFlash drafters: a sliding layer's block token sees no later
    block token; a full layer's sees all of them."""
    before, after = _slot_outputs_after_changing_slot(make_drafter(["sliding_attention"] * 2, 16), 5)
    assert torch.equal(before[:, :5], after[:, :5]) and not torch.allclose(before[:, 5:], after[:, 5:])
    before, after = _slot_outputs_after_changing_slot(make_drafter(["full_attention"] * 2), 5)
    assert not torch.allclose(before[:, :5], after[:, :5])


def test_sliding_window_counts_the_query_and_reaches_into_the_context():
    """W keys end at the query: slot k of a block at anchor p sees context from p+k-(W-1) on. Over
    two layers: context position 8 reaches slot 0 (position 11, window 8..11) in layer 1, and in
    layer 2 the slots whose window holds position 11 (slots 0..3), no further."""
    model = make_drafter(["sliding_attention"] * 2, 4)
    noise, feats, pos = inputs(ctx=11)
    with torch.no_grad():
        before = model(noise, feats, pos)
        feats = feats.clone()
        feats[:, 8] += 1.0
        after = model(noise, feats, pos)
    changed = [not torch.allclose(before[:, k], after[:, k]) for k in range(8)]
    assert changed == [True] * 4 + [False] * 4


def test_config_records_the_sliding_rule_and_no_causal_flag(tmp_path):
    import json

    make_drafter(["sliding_attention", "full_attention"], 6).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dflash_sliding_attention"] == "causal_window"
    assert "is_causal" not in config and "causal" not in config["dflash_config"]


def test_a_dflash_drafter_from_before_the_sliding_rule_is_flagged_on_load(tmp_path, caplog):
    import json

    make_drafter(["sliding_attention", "full_attention"], 6).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["dflash_sliding_attention"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "train_state").mkdir()
    (tmp_path / "train_state/manifest.json").write_text("{}")  # trained by dflash
    with caplog.at_level("WARNING"):
        load_drafter(str(tmp_path))
    assert "before its sliding-attention layers followed the served rule" in caplog.text


def test_gradient_checkpointing_gives_the_same_gradients():
    """train.gradient_checkpointing recomputes each layer in backward: same loss, same gradients, and
    transformers' own switch reaches it (it used to raise: the layers had no checkpointing flag)."""
    from dflash.drafter.blocks import draft_packed, pack_blocks

    embed = torch.nn.Embedding(300, 64)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 290, (2, 30), generator=g)
    feats = torch.randn(2, 30, 3 * 64, generator=g)
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([30, 24]),
                         [torch.tensor([2, 9, 20]), torch.tensor([5, 11])], 8, 299)
    grads, losses = [], []
    for checkpointing in (False, True):
        drafter = make_drafter(["sliding_attention", "full_attention"], 6).train()
        if checkpointing:
            drafter.gradient_checkpointing_enable()
            assert drafter.gradient_checkpointing
        calls = []
        drafter.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
        loss = draft_packed(drafter, embed, feats, blocks).square().mean()
        loss.backward()
        assert len(calls) == (2 if checkpointing else 1)  # recomputed in backward
        losses.append(loss.item())
        grads.append({n: p.grad.clone() for n, p in drafter.named_parameters()})
    assert losses[0] == pytest.approx(losses[1], abs=1e-7)
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-6), name


def test_sliding_layers_without_a_window_are_refused_naming_the_fix(tmp_path):
    """Qwen3Config nulls sliding_window when use_sliding_window is false: such a sliding layer would train and
    evaluate as full attention and fail in live decoding, so neither building nor loading it goes through."""
    import json

    cfg = drafter_config(TARGET, num_layers=2, block_size=8, target_layer_ids=[1, 5, 9], mask_token_id=299,
                         layer_types=["sliding_attention", "full_attention"], sliding_window=None)
    with pytest.raises(ValueError, match=r"drafter layers \[0\] are sliding_attention but sliding_window is null.*"
                                         r"set sliding_window.*or make those layers full_attention"):
        DFlashDraftModel(cfg)
    make_drafter(["sliding_attention", "full_attention"], 6).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_sliding_window": False}))  # window: 6, kept
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/config.json: drafter layers \[0\] are sliding_attention"):
        load_drafter(str(tmp_path))


def test_block_size_is_read_from_dflash_config_first_and_a_disagreement_is_refused(tmp_path):
    """The z-lab reference reads dflash_config.block_size before the top-level key; we read the top level first and
    served a drafter whose two disagree at the other size without a word. Either one alone is read; two that
    disagree are refused on load in one line naming both."""
    from dflash.drafter.model import block_size_of

    make_drafter().save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    top = config["block_size"]
    nested = {**{k: v for k, v in config.items() if k != "block_size"},
              "dflash_config": {**config["dflash_config"], "block_size": top // 2}}
    (tmp_path / "config.json").write_text(json.dumps(nested))
    assert load_drafter(str(tmp_path)).block_size == top // 2
    both = {**nested, "block_size": top}
    assert block_size_of(SimpleNamespace(dflash_config={"block_size": 4}, block_size=4)) == 4
    (tmp_path / "config.json").write_text(json.dumps(both))
    with pytest.raises(CheckpointError, match=rf"{tmp_path}/config.json: drafter config.json says "
                                              rf"dflash_config.block_size={top // 2} and block_size={top}; set both"):
        load_drafter(str(tmp_path))
