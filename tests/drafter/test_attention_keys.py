"""Every attention key the servers read (is_causal, dflash_config.causal/use_swa/swa_window_size, layer_types,
sliding_window), read as vLLM reads them; combinations the servers would read differently are refused, and our
exports write the keys so that every reader, the z-lab reference included, gets the same rules back."""

from types import SimpleNamespace

import pytest

from dflash.drafter.build import drafter_config
from dflash.drafter.attention import AttentionRule, attention_rules
from dflash.drafter.model import DFlashDraftModel
from tests.drafter.test_model import TARGET
from tests.zlab import reference

S, F = "sliding_attention", "full_attention"
FULL = AttentionRule(False, None)


def config(types=(S, F), window=6, **keys):
    dflash = {k: keys.pop(k) for k in ("causal", "use_swa", "swa_window_size") if k in keys}
    return SimpleNamespace(num_hidden_layers=2, layer_types=list(types) if types else None, sliding_window=window,
                           dflash_config=dflash, **keys)


TABLE = [  # (keys, rules or the refusal's words)
    ({"types": (F, F), "window": None}, [FULL, FULL]),
    ({}, [AttentionRule(True, 6), FULL]),  # no causal key: the layer type decides (sliding causal)
    ({"is_causal": False}, [AttentionRule(False, 6), FULL]),  # top level: every layer
    ({"is_causal": True}, [AttentionRule(True, 6), AttentionRule(True, None)]),
    ({"is_causal": False, "causal": False}, [AttentionRule(False, 6), FULL]),
    ({"types": (S, S), "causal": True}, [AttentionRule(True, 6)] * 2),  # what the layer types say anyway
    ({"use_swa": True, "swa_window_size": 6}, [AttentionRule(True, 6), FULL]),
    ({"types": None, "window": None}, [FULL, FULL]),
    ({"causal": False}, "without is_causal"),  # vLLM: every layer; SGLang and the reference: the layer type
    ({"is_causal": True, "causal": False}, "disagree"),
    ({"types": (F, F), "use_swa": True}, "no layer is sliding_attention"),
    ({"swa_window_size": 4}, "swa_window_size=4 but sliding_window=6"),
    ({"types": None, "use_swa": True}, "without layer_types"),
    ({"types": None, "is_causal": True}, "without layer_types"),
]


@pytest.mark.parametrize("keys,expected", TABLE, ids=[str(k) for k, _ in TABLE])
def test_attention_keys_are_read_as_the_servers_read_them(keys, expected):
    keys = dict(keys)
    cfg = config(keys.pop("types", (S, F)), keys.pop("window", 6), **keys)
    if isinstance(expected, str):
        with pytest.raises(ValueError, match=expected):
            attention_rules(cfg)
    else:
        assert attention_rules(cfg) == expected


@pytest.mark.parametrize("types,causal", [((F, F), True), ((S, F), True), ((S, F), False), ((S, S), False),
                                          ((S, S), True)])
def test_exports_write_keys_every_reader_gets_the_same_rules_from(types, causal):
    cfg = drafter_config(TARGET, num_layers=2, block_size=8, target_layer_ids=[1, 5, 9], mask_token_id=299,
                         layer_types=list(types), sliding_window=6 if S in types else None, sliding_causal=causal)
    want = [AttentionRule(causal, 6) if t == S else FULL for t in types]
    assert attention_rules(cfg) == want == DFlashDraftModel(cfg).attention_rules
    theirs = reference().DFlashDraftModel(cfg)  # the z-lab reference's own reading of the same config.json
    assert [(a.self_attn.is_causal, a.self_attn.sliding_window) for a in theirs.layers] == [tuple(r) for r in want]
