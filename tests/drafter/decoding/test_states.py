"""Linear-attention states recorded during verification: after a partial accept, the cache equals a fresh
prefill of the committed text, with no replay forward."""

import pytest
import torch

from dflash.drafter.decoding.states import (StateRecorder, commit, gated_delta_states, linear_layers, new_cache,
                                            select_rows, settle)
from dflash.target.features import target_forward


def test_gated_delta_states_follow_transformers_recurrent_kernel():
    """Our per-position states are the state transformers' own token-by-token kernel leaves after each prefix."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_recurrent_gated_delta_rule

    g = torch.Generator().manual_seed(0)
    b, T, hk, hv, dk, dv = 2, 5, 2, 4, 8, 6
    q, k = torch.randn(b, T, hk, dk, generator=g), torch.randn(b, T, hk, dk, generator=g)
    v = torch.randn(b, T, hv, dv, generator=g)
    decay, beta = -torch.rand(b, T, hv, generator=g), torch.rand(b, T, hv, generator=g)
    init = torch.randn(b, hv, dk, dv, generator=g)
    rows = [[0], [1], [0, 1], [], [1]]
    got = gated_delta_states(k, v, decay, beta, init, True, rows)
    want = []
    for t, wanted in enumerate(rows):
        _, final = torch_recurrent_gated_delta_rule(q[:, : t + 1], k[:, : t + 1], v[:, : t + 1], g=decay[:, : t + 1],
                                                    beta=beta[:, : t + 1], initial_state=init, output_final_state=True,
                                                    use_qk_l2norm_in_kernel=True)
        want += [final[r] for r in wanted]
    assert got.shape == (5, hv, dk, dv) and torch.allclose(got, torch.stack(want), atol=1e-5)


def _prefill(target, ids):
    cache = new_cache(target, recording=True)
    target_forward(target, ids, [], cache=cache)
    settle(cache)
    return cache


def _assert_same_state(cache, fresh):
    assert len(cache.layers) == len(fresh.layers)
    for mine, theirs in zip(cache.layers, fresh.layers):
        if hasattr(mine, "recurrent_states"):
            assert torch.allclose(mine.conv_states[0], theirs.conv_states[0], atol=1e-5)
            assert torch.allclose(mine.recurrent_states[0], theirs.recurrent_states[0], atol=1e-5)
        else:
            assert mine.keys.shape == theirs.keys.shape
            assert torch.allclose(mine.keys, theirs.keys, atol=1e-5)
            assert torch.allclose(mine.values, theirs.values, atol=1e-5)


@pytest.mark.parametrize("kept", [1, 3, 6])
def test_partial_accept_leaves_the_state_of_a_fresh_prefill(tiny_targets, kept):
    target = tiny_targets["tiny_qwen3_5"]
    ids = torch.randint(0, 256, (1, 20), generator=torch.Generator().manual_seed(kept))
    p, block = 14, ids[:, 14:]
    cache = _prefill(target, ids[:, :p])
    recorder = StateRecorder(target, [(0, t) for t in range(block.shape[1])])
    with recorder.recording():
        target_forward(target, block, [], cache=cache)
    commit(cache, p, kept, block.shape[1], recorder.state(kept - 1))
    _assert_same_state(cache, _prefill(target, ids[:, : p + kept]))


def test_a_row_of_a_batch_of_paths_commits_like_a_prefill(tiny_targets):
    target = tiny_targets["tiny_qwen3_5"]
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(9))
    p = 12
    cache = _prefill(target, ids[:, :p])
    paths = torch.tensor([[int(ids[0, p]), 7, 8, 9], [int(ids[0, p]), 5, 6, 6]])
    select_rows(cache, torch.zeros(2, dtype=torch.long))
    recorder = StateRecorder(target, [(1, 2)])
    with recorder.recording():
        target_forward(target, paths, [], cache=cache)
    select_rows(cache, torch.tensor([1]))
    commit(cache, p, 3, 4, recorder.state(0))
    _assert_same_state(cache, _prefill(target, torch.cat([ids[:, : p + 1], torch.tensor([[5, 6]])], 1)))


def test_rejected_tokens_without_a_recorded_state_are_refused(tiny_targets):
    target = tiny_targets["tiny_qwen3_5"]
    cache = _prefill(target, torch.arange(10)[None])
    target_forward(target, torch.arange(4)[None], [], cache=cache)
    with pytest.raises(ValueError, match="no state was recorded"):
        commit(cache, 10, 2, 4, None)
    assert linear_layers(cache)


def test_a_recorder_names_a_forward_it_did_not_see(tiny_targets):
    with pytest.raises(RuntimeError, match="no recorded state"):
        StateRecorder(tiny_targets["tiny_qwen3_5"], [(0, 0)]).state(0)
