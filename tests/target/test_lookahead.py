import pytest
import torch
from transformers import Qwen3_5ForCausalLM

from dflash.target.builtin import tiny_qwen3_5_config
from dflash.target.layer_ids import build_target_layer_ids
from dflash.target.lookahead import LookaheadHeads, deepen, layer_pattern, shifted_labels

L, F = "linear_attention", "full_attention"


def tiny(num_layers: int = 8):
    torch.manual_seed(0)
    config = tiny_qwen3_5_config(96)
    config.num_hidden_layers, config.layer_types = num_layers, layer_pattern(config, num_layers)
    return Qwen3_5ForCausalLM(config).eval()


def test_deepen_appends_the_hybrid_pattern_and_computes_what_the_model_did():
    model = tiny(8)
    ids = torch.randint(0, 96, (2, 24))
    deeper = deepen(model, 12).eval()
    assert deeper.config.layer_types == [L, L, L, F] * 3 and len(deeper.model.layers) == 12
    with torch.no_grad():
        torch.testing.assert_close(deeper(ids).logits, model(ids).logits, rtol=1e-5, atol=1e-5)
    assert deeper.model.layers[11].self_attn.o_proj.weight.abs().sum() == 0
    assert deeper.model.layers[8].linear_attn.out_proj.weight.abs().sum() == 0
    with pytest.raises(ValueError, match="already has 8"):
        deepen(model, 8)


def test_layer_pattern_refuses_types_that_do_not_repeat():
    config = tiny_qwen3_5_config(96)
    config.layer_types = [L, F, L, L]
    with pytest.raises(ValueError, match="do not repeat"):
        layer_pattern(config, 8)


def test_shifted_labels_put_the_token_k_ahead_at_each_position():
    labels = torch.tensor([[-100, 11, 12, 13, 14]])
    assert shifted_labels(labels, 2).tolist() == [[12, 13, 14, -100, -100]]
    assert shifted_labels(labels, 1).tolist() == [[11, 12, 13, 14, -100]]


def test_heads_read_the_last_reference_layer_and_learn_tokens_ahead():
    model = tiny(12)
    for p in model.parameters():
        p.requires_grad_(False)
    heads = LookaheadHeads.attach(model, (2, 3))
    assert heads.layer == build_target_layer_ids(12, 5)[-1] == 9
    ids = torch.arange(10, 17).repeat(1, 8)  # period 7: the token 2 or 3 ahead follows from this one
    out = model(ids, output_hidden_states=True)
    torch.testing.assert_close(heads.caught["hidden"], out.hidden_states[10])  # the output of layer 9
    opt = torch.optim.Adam(heads.parameters(), lr=3e-2)
    first = None
    for _ in range(150):
        model(ids)
        loss = sum(heads.loss(ids, model.lm_head.weight))
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.2 * first, (first, loss.item())
