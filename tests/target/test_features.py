"""The target's feature forward at long context: right-padded batches build nothing [L, L]-sized."""

from types import SimpleNamespace

import pytest
import torch

from bench.measure import TensorPeak
from dflash.target.features import batched_features, target_forward
from dflash.train.step import batch_features

L = 4096


def sequences(lengths: list[int]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 250, (n,), generator=g) for n in lengths]


@pytest.mark.parametrize("name", ["tiny_qwen3", "tiny_qwen3_5"])
def test_a_right_padded_batch_builds_no_dense_mask_and_equals_each_sequence_alone(name, tiny_targets):
    """Extraction batches sequences of different lengths, right-padded. A [b, L] padding mask made transformers
    build a dense [b, 1, L, L] one (and a float copy per layer: 180 MiB for this batch of two, 64 times that at 32k); a
    causal target needs none for the real positions, which now come out exactly as each sequence's alone."""
    target = tiny_targets[name]
    seqs = sequences([L, L * 5 // 8])
    with TensorPeak() as mem:
        got = {i: f for i, f, _ in batched_features(target, seqs, [1, 3], 2 * L)}
    assert mem.largest[0] < L * L, f"{mem.largest}: a dense [L, L] tensor"
    for i, s in enumerate(seqs):
        assert torch.equal(got[i], target_forward(target, s[None], [1, 3]).features[0])


def test_online_training_features_of_a_padded_micro_batch_build_no_dense_mask(tiny_targets):
    """Online training's target forward (dflash.train.step.batch_features) on a right-padded micro-batch."""
    target = tiny_targets["tiny_qwen3"]
    seqs = sequences([L, L // 2])
    ids = torch.zeros(2, L, dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : s.numel()] = s
    batch = SimpleNamespace(features=None, input_ids=ids, lengths=torch.tensor([L, L // 2]), num_tokens=L + L // 2)
    with TensorPeak() as mem:
        features = batch_features(SimpleNamespace(device=torch.device("cpu")), target,
                                  SimpleNamespace(target_layer_ids=[1, 3]), batch)
    assert mem.largest[0] < L * L, f"{mem.largest}: a dense [L, L] tensor"
    assert torch.equal(features[1, : L // 2], target_forward(target, seqs[1][None], [1, 3]).features[0])
