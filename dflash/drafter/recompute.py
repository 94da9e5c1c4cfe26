"""How training runs the drafter's layers: what it recomputes in backward (train.gradient_checkpointing) and whether
it compiles them (train.compile=layers, `compile_layers`). Kept out of model.py, which exports copy and whose
`train_layer` only calls `torch.utils.checkpoint.checkpoint` with the drafter's `checkpoint_contexts`.

- full: each layer keeps its inputs and recomputes everything in backward: its matmuls too, about a third
  more of the step's FLOPs.
- selective: each layer keeps its inputs and the outputs of its matmuls and attention (SAVED), and recomputes only
  the rest (norms, rotary, SiLU x up, casts, DFlash 2's convolutions), keeping 38% of what no checkpointing keeps at
  the Qwen3-8B and Qwen3.6-27B recipes' layers (dflash.plan.memory.selective_outputs counts it; tests/plan/test_plan.py
  measures it on CPU). PyTorch's selective activation checkpointing (`create_selective_checkpoint_contexts`)
  replays the layer in backward and hands each saved op its output from forward instead of running it again.
  Its price is a Python dispatch mode over every op of the layers, forward and replay: on the 2-core CPU that made
  the layers' forward 1.25x slower, and selective's step about full's (`python -m bench --only checkpointing`:
  0.96x and 1.03x full's in two runs), where the matmuls dominate less than on a GPU. The GPU check's
  checkpointing_modes times it where it matters (not run yet).

What selective checkpointing needs of the layers: an output of a SAVED op is never changed in place. An in-place
change inside an autograd.Function's forward does not bump the tensor's version, so PyTorch cannot tell: the replay
would get the changed tensor back and the gradients would be silently wrong (packed_attention's own-block scores
were scaled in place, 3e-3 off; tests/drafter/test_recompute.py compares every path's gradients).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts, noop_context_fn

_aten = torch.ops.aten
SAVED = {
    _aten.mm.default, _aten.addmm.default, _aten.bmm.default,  # linear layers, the own-block scores and values
    _aten._scaled_dot_product_flash_attention_for_cpu.default,  # the sdpa path's context part (packed_attention)
    _aten._scaled_dot_product_flash_attention.default, _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,  # train.attention=sdpa on CUDA
    torch.ops.higher_order.flex_attention,  # flex traced inside a compiled region
}
"""The ops whose outputs selective checkpointing keeps: the compute-bound ones."""
if hasattr(torch.ops.higher_order, "inductor_compiled_code"):  # torch >= 2.10: a compiled region (the drafter's
    SAVED.add(torch.ops.higher_order.inductor_compiled_code)  # flex attention) runs as this one op under the replay

MODES = ("off", "selective", "full")
"""The values train.gradient_checkpointing resolves to (auto is decided as training starts, dflash.train.fit)."""


def _policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED else CheckpointPolicy.PREFER_RECOMPUTE


selective_contexts = functools.partial(create_selective_checkpoint_contexts, _policy)
"""torch.utils.checkpoint's context_fn for selective checkpointing."""


def use_checkpointing(drafter: torch.nn.Module, mode) -> None:
    """Make `drafter` (a DFlashDraftModel) recompute its layers in training as `mode` says: off, selective or full
    (MODES)."""
    if mode not in MODES:
        raise ValueError(f"gradient checkpointing mode {mode!r}: expected one of {MODES}")
    drafter.gradient_checkpointing = mode != "off"
    drafter.checkpoint_contexts = selective_contexts if mode == "selective" else noop_context_fn


def compile_layers(drafter: torch.nn.Module, backend: str = "inductor") -> None:
    """train.compile=layers: the drafter's training call of a layer (`train_layer`) compiled, the checkpoint inside
    the graph, so the compiler's partitioner keeps what the mode keeps (a checkpoint around a compiled layer sees it
    as one op, whose outputs selective checkpointing would keep: all that the layer saves). fullgraph: a graph break
    is an error, not a slow step. Weight names do not change; evaluation and decoding run eager."""
    drafter.train_layer = torch.compile(drafter.train_layer, backend=backend, fullgraph=True)
