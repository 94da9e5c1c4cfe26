"""Target caches that a verification can roll back exactly, without a second forward.

Attention layers keep every position (sliding-window layers included: a sliding layer's own
cache drops what leaves the window, so a rejected draft could not be undone; the window is the
model's mask, not the cache) and are cropped to the committed length.

Linear-attention (Gated DeltaNet) layers hold a convolution window and a recurrent state; both
have seen every verified token, rejected ones too, and neither can be cropped. Servers keep the
state of each verified position instead (SGLang's extra buffer for mamba-style layers); so do we:
- the convolution inputs are kept whole during a forward (transformers' past recording) and cut
  back to the window that ends at the last committed token (`LinearAttentionLayer.crop`);
- the recurrent state after each verified position is computed beside the layer's own kernel,
  from the kernel's own inputs (`StateRecorder`): the gated delta rule, one position at a time,
  S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T  (k_t L2-normalised when the
  layer asks its kernel to), in float32 as the kernels keep it. The layer's outputs, and so the
  target's logits and features, still come from its own kernel.
The committed state is then that of the last accepted position: what a prefill of the committed
text leaves, up to float rounding (tests/drafter/decoding/test_states.py), with no replay forward.

Recording costs one [value heads, key dim, value dim] float32 state per recorded position per
linear layer (Qwen3.5/3.6-27B: 48 layers x 48 x 128 x 128 x 4 B = 151 MB a position; 16 for a
chain block). A tree verified as a batch of paths records each node once, not once per path.
"""

from __future__ import annotations

import inspect
import sys
from contextlib import contextmanager

import torch

KERNEL = "torch_chunk_gated_delta_rule"
"""The module-level name through which transformers' Gated DeltaNet layers call their chunked kernel
(fla's when installed, else transformers' PyTorch one); multi-token forwards go through it."""


def _kernel_interface(query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                      use_qk_l2norm_in_kernel=False, **kwargs):
    """The arguments of transformers' torch_chunk_gated_delta_rule, as its Gated DeltaNet layers pass them. Read
    from here, not from the kernel: from transformers 5.25 on the module-level name is a hub-kernel dispatcher
    whose own signature is (*args, **kwargs)."""


_KERNEL_SIGNATURE = inspect.signature(_kernel_interface)


def new_cache(target, recording: bool):
    """A DynamicCache whose attention layers keep every position; `recording`: linear-attention layers keep
    their whole convolution input during each forward, until `commit` (or `settle`) cuts it back."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    cache = DynamicCache(config=target.config)
    cache.layers = [DynamicLayer() if isinstance(layer, DynamicSlidingWindowLayer) else layer
                    for layer in cache.layers]
    if recording:
        for layer in linear_layers(cache):
            # transformers >= 5.25 can also compute the last N recurrent states itself (N = 0 here: StateRecorder
            # computes the ones verification needs, for a tree's paths too); before 5.25 there is no such argument
            if "recurrent_states_to_keep" in inspect.signature(layer.activate_past_recording).parameters:
                layer.activate_past_recording(recurrent_states_to_keep=0)
            else:
                layer.activate_past_recording()
    return cache


def linear_layers(cache) -> list:
    return [layer for layer in cache.layers if hasattr(layer, "recurrent_states")]


def attention_layers(cache) -> list:
    return [layer for layer in cache.layers if not hasattr(layer, "recurrent_states")]


def settle(cache) -> None:
    """After a forward that commits everything it saw (the prefill): cut recorded convolution inputs back to
    the window."""
    for layer in linear_layers(cache):
        if layer.record_past and layer.is_conv_states_initialized[0]:
            layer.crop(0)


def crop_attention(cache, length: int) -> None:
    """Drop the attention KV of positions >= length, through the cache layers' own crop."""
    for layer in attention_layers(cache):
        extra = layer.get_seq_length() - length
        if extra > 0:
            layer.crop(-extra)


def keep_attention(cache, keep: torch.Tensor) -> None:
    """Keep only the KV entries at indices `keep` (the accepted path of a tree verified in one sequence)."""
    for layer in attention_layers(cache):
        if layer.get_seq_length():
            layer.keys = layer.keys.index_select(-2, keep)
            layer.values = layer.values.index_select(-2, keep)


def select_rows(cache, rows: torch.Tensor) -> None:
    """Every layer's cache (KV, convolution and recurrent states) at batch rows `rows`: zeros(n) expands a
    one-row cache to n copies (a batch of tree paths), [r] keeps row r. Beam search's reorder, per layer."""
    for layer in cache.layers:
        layer.reorder_cache(rows)


def commit(cache, past: int, kept: int, verified: int, state: dict[int, torch.Tensor] | None) -> None:
    """Leave `cache` (one row) holding exactly positions < past + kept after a forward of `verified` tokens at
    positions past.. : attention cropped, convolution windows ending at the last kept token, recurrent
    states set to `state` (layer index -> [1, H, Dk, Dv], the kept position's, from a StateRecorder; None when
    every verified token is kept: the forward's own final state stands)."""
    crop_attention(cache, past + kept)
    for index, layer in enumerate(cache.layers):
        if not hasattr(layer, "recurrent_states"):
            continue
        if state is None and kept < verified:
            raise ValueError("commit: a linear-attention layer saw rejected tokens and no state was recorded for "
                             "the last kept one")
        committed = None if state is None else state[index].to(layer.recurrent_states[0].dtype).contiguous()
        if committed is not None and kept < verified and hasattr(layer, "recurrent_states_history"):
            # transformers >= 5.25 restores a cropped layer's recurrent state from a history it keeps only when it
            # computes the states itself (recurrent_states_to_keep > 0, see new_cache): hand it ours
            layer.recurrent_states_history = {0: [committed] * (verified - kept)}
        layer.crop(kept - verified)
        if committed is not None:
            layer.recurrent_states[0] = committed


def gated_delta_states(key, value, g, beta, initial_state, l2norm: bool, rows: list[list[int]]) -> torch.Tensor:
    """Recurrent states after chosen positions of a gated delta rule; rows[t] lists the batch rows whose state
    after position t is wanted. key [b, T, Hk, Dk], value [b, T, Hv, Dv], g and beta [b, T, Hv];
    initial_state [b, Hv, Dk, Dv] or None (zeros). Returns [sum(len(r) for r in rows), Hv, Dk, Dv] float32,
    position by position, row by row."""
    b, T, hk, dk = key.shape
    hv, dv = value.shape[-2:]
    k = key.float()
    if l2norm:
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    if hv != hk:
        k = k.repeat_interleave(hv // hk, dim=2)
    state = (torch.zeros(b, hv, dk, dv, device=key.device) if initial_state is None
             else initial_state.float().clone())
    kept = []
    for t in range(min(T, len(rows))):
        state = state * g[:, t].float().exp()[..., None, None]
        k_t = k[:, t]
        delta = (value[:, t].float() - (state * k_t[..., None]).sum(-2)) * beta[:, t].float()[..., None]
        state = state + k_t[..., None] * delta[..., None, :]
        if rows[t]:
            kept.append(state[rows[t]])
    return torch.cat(kept) if kept else torch.zeros(0, hv, dk, dv, device=key.device)


class StateRecorder:
    """Within `with recorder.recording():`, each multi-token forward of the target's linear-attention layers
    also stores the recurrent state after the positions `wanted` names ([(row, t)], in the order the caller
    indexes them): `recorder.state(i)` is then {layer index: [1, Hv, Dk, Dv]} for entry i of `wanted`."""

    def __init__(self, target, wanted: list[tuple[int, int]]):
        self.wanted = wanted
        self.mixers = {i: layer.linear_attn for i, layer in enumerate(target.layers)
                       if target.layer_types[i] == "linear_attention"}  # (Qwen3.5, Qwen3-Next: `linear_attn`)
        self.states: dict[int, torch.Tensor] = {}
        self._current: int | None = None

    def state(self, entry: int) -> dict[int, torch.Tensor]:
        missing = set(self.mixers) - set(self.states)
        if missing:
            raise RuntimeError(f"no recorded state for linear-attention layers {sorted(missing)}: the forward did "
                               f"not go through transformers' {KERNEL} (a single-token forward, or a kernel this "
                               f"recorder does not know)")
        return {layer: states[entry: entry + 1] for layer, states in self.states.items()}

    def _rows_per_position(self, T: int) -> tuple[list[list[int]], list[int]]:
        """rows[t] for gated_delta_states, and where each wanted (row, t) lands in its output."""
        rows: list[list[int]] = [sorted({row for row, t in self.wanted if t == u}) for u in range(T)]
        offsets = [sum(len(r) for r in rows[:t]) for t in range(T)]
        return rows, [offsets[t] + rows[t].index(row) for row, t in self.wanted]

    def _wrap(self, kernel):
        def recording_kernel(*args, **kwargs):
            out = kernel(*args, **kwargs)
            a = _KERNEL_SIGNATURE.bind(*args, **kwargs).arguments
            rows, order = self._rows_per_position(a["key"].shape[1])
            states = gated_delta_states(a["key"], a["value"], a["g"], a["beta"], a.get("initial_state"),
                                        bool(a.get("use_qk_l2norm_in_kernel", False)), rows)
            self.states[self._current] = states[order]
            return out

        return recording_kernel

    @contextmanager
    def recording(self):
        modules = {type(m).__module__ for m in self.mixers.values()}
        saved = {}
        for name in modules:
            module = sys.modules[name]
            if not hasattr(module, KERNEL):
                raise RuntimeError(f"{name} has no {KERNEL}: cannot record the linear-attention states of this "
                                   f"target's verification (transformers changed how its Gated DeltaNet layers call "
                                   f"their kernel)")
            saved[name] = getattr(module, KERNEL)
        hooks = [m.register_forward_pre_hook(lambda _m, _a, i=i: setattr(self, "_current", i))
                 for i, m in self.mixers.items()]
        try:
            for name, kernel in saved.items():
                setattr(sys.modules[name], KERNEL, self._wrap(kernel))
            yield self
        finally:
            for name, kernel in saved.items():
                setattr(sys.modules[name], KERNEL, kernel)
            for h in hooks:
                h.remove()
