"""train.gradient_checkpointing's modes (dflash.drafter.recompute), eager and through compiled layers
(train.compile=layers): the same gradients, and what each replays."""

from contextlib import nullcontext

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dflash.drafter.blocks import draft_packed, pack_blocks
from dflash.drafter.build import drafter_config
from dflash.drafter.model import DFlashDraftModel
from dflash.drafter.recompute import MODES, SAVED, compile_layers, use_checkpointing
from tests.drafter.test_dflash2 import make_dflash2
from tests.drafter.test_model import TARGET, make_drafter

KINDS = {
    "dflash, sliding and full": lambda: make_drafter(["sliding_attention", "full_attention"], 6),
    "dflash 2": lambda: make_dflash2(["sliding_attention", "full_attention"], 6),
}


def packed_batch():
    """Two sequences, 37 blocks: the sdpa path's context attention in three chunks of up to 16 blocks, one of them
    at anchor 0 (no context key)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 290, (2, 40), generator=g)
    feats = torch.randn(2, 40, 3 * 64, generator=g)
    anchors = [torch.arange(0, 38, 2), torch.tensor([0, *range(3, 37, 2)])]
    blocks = pack_blocks(ids, torch.ones_like(ids, dtype=torch.bool), torch.tensor([40, 38]), anchors, 8, 299)
    return torch.nn.Embedding(300, 64), feats, blocks


class Count(TorchDispatchMode):
    """How many times each op of SAVED ran while active."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func in SAVED
        return func(*args, **(kwargs or {}))


def run(kind: str, mode, autocast: bool = False, compiled: bool = False) -> dict:
    """One packed forward and backward: the loss, every gradient, and the SAVED ops forward and backward ran.
    compiled: the layers compiled as train.compile=layers does, with aot_eager (dynamo and AOT autograd as inductor
    gets them, without its code generation: a graph break fails, in seconds)."""
    drafter = KINDS[kind]().train()
    use_checkpointing(drafter, mode)
    if compiled:
        torch._dynamo.reset()
        compile_layers(drafter, backend="aot_eager")
    embed, feats, blocks = packed_batch()
    count = nullcontext if compiled else Count  # dynamo does not compile under a dispatch mode of ours
    with count() as forward, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = draft_packed(drafter, embed, feats, blocks, "sdpa").float().square().mean()
    with count() as backward:
        loss.backward()
    return {"loss": loss.item(), "grads": {n: p.grad for n, p in drafter.named_parameters()},
            "forward": forward and forward.calls, "backward": backward and backward.calls}


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16 autocast"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_every_mode_gives_the_same_loss_and_gradients(kind, autocast):
    """Checkpointing replays the layers' ops in their order, so every mode's gradients are those of no
    checkpointing, to the bit. Selective checkpointing once got 3e-3 wrong: the own-block scores, a bmm's output it
    keeps, were scaled in place inside an autograd.Function (no version bump), so the replay scaled them twice."""
    off, *others = (run(kind, mode, autocast) for mode in MODES)
    for mode, got in zip(MODES[1:], others):
        assert got["loss"] == off["loss"], mode
        for name, grad in off["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=0, atol=0, msg=f"{mode}: {name}")


@pytest.mark.parametrize("kind", list(KINDS))
def test_compiled_layers_train_as_eager_ones_in_every_mode(kind):
    """train.compile=layers: each layer one graph (fullgraph: the packed attention's autograd.Function, DFlash 2's
    convolution and the chunked mask trace without a break), in every checkpointing mode the eager loss and
    gradients. (Inductor's code on this CPU: within 1.5e-8 of eager, checked by hand; a test would compile for 20 s.)"""
    eager = run(kind, "off")
    for mode in MODES:
        got = run(kind, mode, compiled=True)
        assert got["loss"] == pytest.approx(eager["loss"], rel=1e-6), mode
        for name, grad in eager["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-5, atol=1e-7, msg=f"{mode}: {name}")


def test_compiled_layers_share_one_graph():
    """Four layers, three sliding and one full, two steps: one graph (the sdpa path's masks are tensors; under flex a
    kind of layer is a mask function, a graph of its own)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    config = drafter_config(TARGET, num_layers=4, block_size=8, target_layer_ids=[1, 5, 9], mask_token_id=299,
                            layer_types=["sliding_attention"] * 3 + ["full_attention"], sliding_window=6)
    drafter = DFlashDraftModel(config).train()
    use_checkpointing(drafter, "selective")
    compile_layers(drafter, backend="aot_eager")
    embed, feats, blocks = packed_batch()
    for _ in range(2):
        draft_packed(drafter, embed, feats, blocks, "sdpa").square().mean().backward()
    assert counters["stats"]["unique_graphs"] == 1


def test_compiled_layers_keep_what_each_mode_keeps():
    """The checkpoint is inside the compiled graph, so the partitioner keeps what the mode keeps: the tensors the
    compiled layers save for backward fall from no checkpointing to selective to full (a checkpoint around a
    compiled layer would have selective keep all of them)."""
    saved = {}
    for mode in MODES:
        torch._dynamo.reset()
        drafter = KINDS["dflash, sliding and full"]().train()
        use_checkpointing(drafter, mode)
        compile_layers(drafter, backend="aot_eager")
        embed, feats, blocks = packed_batch()
        storages = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            draft_packed(drafter, embed, feats, blocks, "sdpa").square().mean().backward()
        saved[mode] = sum(storages.values())
    assert saved["off"] > saved["selective"] > saved["full"]
    assert saved["selective"] / saved["off"] < 0.75  # 0.63 at this tiny shape


@pytest.mark.parametrize("kind", list(KINDS))
def test_selective_checkpointing_replays_no_matmul_and_full_replays_the_forwards(kind):
    """In backward, selective checkpointing runs the matmuls and attention no checkpointing runs (their gradients'):
    the replay takes the forward's outputs. Full checkpointing runs the layers' forward ones again on top."""
    off, selective, full = (run(kind, mode) for mode in MODES)
    assert off["forward"] == full["forward"] == selective["forward"] > 0
    assert selective["backward"] == off["backward"]
    # full: the layers' forward ops again (all but fc's, outside the layers), but for what the replay's early stop
    # leaves out: a DFlash layer's down_proj, whose output its backward does not need (DFlash 2's convolution does)
    replayed, layers = full["backward"] - off["backward"], off["forward"] - 1
    assert replayed == (layers if kind == "dflash 2" else layers - 2)


def test_a_mode_that_does_not_exist_is_refused():
    with pytest.raises(ValueError, match="'some'"):
        use_checkpointing(make_drafter(), "some")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention trains on CUDA only")
@pytest.mark.parametrize("kind", list(KINDS))
def test_selective_checkpointing_through_compiled_flex_gives_the_same_gradients(kind):
    """The GPU path: flex attention compiled (its region one op under the replay, torch >= 2.10), bf16 autocast."""
    results = []
    for mode in MODES:
        drafter = KINDS[kind]().cuda().train()
        use_checkpointing(drafter, mode)
        embed, feats, blocks = packed_batch()
        embed, feats = embed.cuda(), feats.cuda()
        blocks = type(blocks)(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in vars(blocks).items()})
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = draft_packed(drafter, embed, feats, blocks, "flex").float().square().mean()
        loss.backward()
        results.append((loss.item(), {n: p.grad for n, p in drafter.named_parameters()}))
    (off_loss, off_grads), *others = results
    for mode, (loss, grads) in zip(MODES[1:], others):
        assert loss == off_loss, mode
        for name, grad in off_grads.items():
            torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=f"{mode}: {name}")
