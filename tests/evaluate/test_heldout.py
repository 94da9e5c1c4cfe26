"""The held-out set's features: stored in the target's dtype, as training's cache and live decoding see them."""

import pytest
import torch
from safetensors import safe_open

from dflash.dist import Dist
from dflash.evaluate import heldout
from dflash.target import load_target, resolve_layer_ids
from dflash.target.features import target_forward
from tests.conftest import tiny_job


def heldout_job(tmp_path, *overrides):
    return tiny_job("evaluate", tmp_path, "eval.max_prompts=2", "eval.max_new_tokens=8", *overrides)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_heldout_set_is_stored_in_the_targets_dtype_exactly(tmp_path, tiny_targets, dtype):
    """A bfloat16 target's held-out features in bfloat16 (half the bytes of float32, nothing lost: it computes
    nothing finer), a float32 target's in float32; an explicit coarser features.storage (training's cache) leaves
    the held-out set exact."""
    job = heldout_job(tmp_path, f"target.dtype={dtype}", "features.storage=float8_e4m3fn")
    target = tiny_targets["tiny_qwen3"] if dtype == "float32" else load_target(job.target, torch.device("cpu"))
    layers = resolve_layer_ids(job.layers, target.num_layers)
    heldout.prepare(job, target, layers, Dist())
    cache = heldout.load(job, target, layers)
    assert (cache.manifest["storage"], cache.manifest["dtype"], cache.manifest["storage_exact"]) == (dtype, dtype, True)
    with safe_open(str(cache.root / cache.manifest["shards"][0]["file"]), "pt") as f:
        assert f.get_slice("features").get_dtype() == {"float32": "F32", "bfloat16": "BF16"}[dtype]
    ids, _, feats = cache[0]
    ref = target_forward(target, ids[None], layers).features[0]
    assert ref.dtype == getattr(torch, dtype) and torch.equal(feats, ref.float())  # one sequence a batch: exact


def test_heldout_answers_batched_by_default_are_the_float32_targets_own(tmp_path, tiny_targets):
    """eval.completions_batch_size defaults to 32 (issue 66, item 3): the held-out prompts, of other lengths, are
    left-padded into one batch, and a float32 target's greedy answers are what it writes for each prompt alone (the
    guarantee the former default of 1 kept; bfloat16 targets: eval.completions_batch_size=1)."""
    from dflash.data.completions import read_store

    target, answers = tiny_targets["tiny_qwen3"], {}
    for batch in (None, 1):
        job = heldout_job(tmp_path / str(batch), "eval.max_prompts=6", "eval.max_new_tokens=12",
                          *([f"eval.completions_batch_size={batch}"] if batch else []))
        assert job.eval.completions_batch_size == (batch or 32)
        layers = resolve_layer_ids(job.layers, target.num_layers)
        heldout.prepare(job, target, layers, Dist())
        store = heldout.heldout_paths(job, target, layers)[1]
        answers[batch] = {k: r["completion_ids"] for k, r in read_store(store).items()}
    assert len(answers[None]) == 6 and answers[None] == answers[1]
