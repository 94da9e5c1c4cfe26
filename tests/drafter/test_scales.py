"""The target's embedding scale, output multiplier and softcap: read from each family, copied into the drafter,
applied to its block embeddings and logits exactly as the z-lab reference applies the exported keys, in the loss
too, and a drafter whose scales differ from its target's refused."""

import pytest
import torch
from torch import nn

from dflash.drafter.build import check_fits, load_drafter, save_drafter
from dflash.drafter.loss import block_terms, slot_weights
from dflash.drafter.build import drafter_config
from dflash.drafter.model import DFlashDraftModel, Scales
from dflash.target.loading import Target
from dflash.target.scales import target_scales
from tests.drafter.test_model import TARGET, inputs
from tests.zlab import reference

B, MASK = 8, 299
CHANGED = {"input_embedding_scale": 3.0, "output_multiplier": 0.25, "final_logit_softcapping": 0.5}


def make(scales: Scales, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    cfg = drafter_config(TARGET, num_layers=2, block_size=B, target_layer_ids=[1, 5, 9], mask_token_id=MASK,
                         scales=scales)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


class Stub(nn.Module):
    """What the reference decoder takes as the target: an embedding table and a head."""

    def __init__(self, seed=3):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.embed_tokens = nn.Embedding.from_pretrained(torch.randn(300, 64, generator=g))
        self.lm_head = nn.Linear(64, 300, bias=False)
        self.lm_head.weight.data = 4 * torch.randn(300, 64, generator=g)  # logits of a few units: the cap bends them

    def get_input_embeddings(self):
        return self.embed_tokens


def ours(model: DFlashDraftModel, stub: Stub, ids, feats, pos) -> torch.Tensor:
    noise = model.scales.embed(stub.embed_tokens.weight, ids)
    return model.scales.finish(stub.lm_head(model(noise, feats, pos)).float())


@pytest.mark.parametrize("keys", [{k: v} for k, v in CHANGED.items()] + [CHANGED], ids=[*CHANGED, "all"])
def test_each_scale_changes_the_logits_as_the_reference_computes_them(tmp_path, keys):
    ref, stub = reference(), Stub()
    _, feats, pos = inputs(ctx=11, q=B)
    ids = torch.full((2, B), MASK)
    ids[:, 0] = torch.tensor([4, 9])
    plain, scaled = make(Scales()), make(Scales(**keys))
    save_drafter(scaled, tmp_path)
    theirs = ref.DFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    with torch.no_grad():
        scale = float(ref._draft_value(theirs.config, "input_embedding_scale", 1.0))
        noise = ref._raw_input_embeddings(stub, ids, scale)
        hidden = theirs(position_ids=pos, noise_embedding=noise, target_hidden=feats)
        expected = theirs.compute_logits(hidden, stub.lm_head)
        got, before = ours(scaled, stub, ids, feats, pos), ours(plain, stub, ids, feats, pos)
    assert (got - expected).abs().max() < 1e-4
    assert (got - before).abs().max() > 1e-2  # the key matters: same weights, other logits
    assert load_drafter(str(tmp_path)).scales == Scales(**keys)  # the export reads back
    if "final_logit_softcapping" in keys:
        assert got.abs().max() <= keys["final_logit_softcapping"]


def test_the_loss_scores_the_scaled_logits():
    torch.manual_seed(0)
    hidden, head = torch.randn(2, B, 64), 4 * torch.randn(300, 64)
    labels = torch.randint(0, 300, (2, B))
    mask = torch.ones(2, B, dtype=torch.bool)
    mask[:, 0] = False
    scales = Scales(**CHANGED)
    terms = block_terms(hidden, head, labels, mask, 7.0, scales=scales)
    logits = scales.finish(hidden @ head.T)
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 300), labels.reshape(-1), reduction="none")
    w = (slot_weights(B, 7.0) * mask).reshape(-1)
    assert terms.loss_sum == pytest.approx(float((ce * w).sum()), rel=1e-5)
    assert terms.loss_sum != pytest.approx(float(block_terms(hidden, head, labels, mask, 7.0).loss_sum), rel=1e-3)


def test_each_family_s_scales_are_read_from_its_config_or_module():
    from transformers import CohereConfig, Gemma4TextConfig, GraniteConfig, LlamaConfig

    small = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8}
    gemma = Gemma4TextConfig(**small, global_head_dim=8, hidden_size_per_layer_input=0, final_logit_softcapping=30.0,
                             layer_types=["full_attention"])
    assert target_scales(gemma) == {"input_embedding_scale": 4.0, "output_multiplier": 1.0,
                                    "final_logit_softcapping": 30.0}  # sqrt(16), from a meta-device build
    assert target_scales(GraniteConfig(**small, logits_scaling=8.0))["output_multiplier"] == 0.125
    assert target_scales(CohereConfig(**small, logit_scale=0.0625))["output_multiplier"] == 0.0625
    assert target_scales(LlamaConfig(**small)) == {"input_embedding_scale": 1.0, "output_multiplier": 1.0,
                                                   "final_logit_softcapping": None}


def test_the_loaded_module_and_the_heads_only_load_agree(tiny_family_targets):
    full, heads = tiny_family_targets["tiny_gemma"]
    assert full.scales == heads.scales == {"input_embedding_scale": 8.0, "output_multiplier": 1.0,
                                           "final_logit_softcapping": 1.0}
    # the drafter embeds the table itself, scaled: what the target's own scaled embedding module returns
    ids = torch.tensor([[3, 70, 262]])
    assert torch.equal(Scales(**full.scales).embed(full.embed_tokens.weight, ids), full.embed_tokens(ids))


def test_a_drafter_with_other_scales_than_its_target_runs_with_its_own_and_says_so(caplog):
    """A published Gemma 4 drafter embeds unscaled rows (no input_embedding_scale): it is evaluated as served."""
    drafter = make(Scales(1.0, 1.0, 30.0))
    target = Target(model=None, tokenizer=None, config=TARGET, layers=None, final_norm=None,
                    embed_tokens=nn.Embedding(300, 64), lm_head=nn.Linear(64, 300), mask_token_id=MASK, path="gemma",
                    scales={"input_embedding_scale": 8.0, "output_multiplier": 1.0, "final_logit_softcapping": 30.0})
    with caplog.at_level("WARNING"):
        check_fits(drafter, target)
    assert "input_embedding_scale=1.0, the target gemma 8.0" in caplog.text
    assert "final_logit_softcapping" not in caplog.text
    assert drafter.scales == Scales(1.0, 1.0, 30.0)


def test_logits_of_a_block_slice_are_one_matmul_not_a_copy_of_the_head_per_block():
    """A block's slots 1.. (`hidden[0, :, 1:]`, non-contiguous, 3-D) through the head: on CPU F.linear of such an input
    became a bmm over the head copied once per block ([blocks, H, V]: 10 of the 14 s a 4-prompt held-out evaluation
    of SmolLM2 took, its 49k-row head copied 63 times a forward). The rows go through one mm, with the same logits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    head = torch.randn(500, 32)
    hidden = torch.randn(1, 7, 9, 32)[0, :, 1:]  # 7 blocks, slots 1..8
    assert not hidden.is_contiguous()
    with Ops() as ops:
        logits = Scales().logits(hidden, head)
    assert "aten.bmm" not in ops.seen and ops.seen.count("aten.mm") == 1
    assert logits.shape == (7, 8, 500)
    torch.testing.assert_close(logits, torch.stack([h @ head.T for h in hidden]))
