"""Training data: which sequences each process reads at each step, their anchors and noise.

Everything random is seeded from (train.seed, what, epoch, sequence index), never from a
process's RNG stream, so the data a step sees is the same whatever the number of processes,
and a resumed run sees exactly what the uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from dflash.config import NoiseConfig
from dflash.drafter.blocks import PackedBlocks, pack_blocks, sample_anchors
from dflash.drafter.loss import slot_weights


def seed_for(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class Schedule:
    """Global batch = batch_size x world x grad_accum sequences per optimizer step; an epoch is
    a seeded permutation of all sequences, its last global batch topped up from its start."""

    num_sequences: int
    batch_size: int
    world: int
    grad_accum: int
    seed: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.num_sequences / self.global_batch))

    def permutation(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(seed_for(self.seed, "order", epoch))
        return torch.randperm(self.num_sequences, generator=g).tolist()

    def micro_batch(self, step: int, micro: int, rank: int) -> tuple[int, list[int]]:
        """(epoch, sequence indices) for one process's micro-batch of an optimizer step."""
        epoch, within = divmod(step, self.steps_per_epoch)
        perm = self.permutation(epoch)
        start = within * self.global_batch + (micro * self.world + rank) * self.batch_size
        return epoch, [perm[(start + j) % self.num_sequences] for j in range(self.batch_size)]


@dataclass
class Batch:
    step: int
    micro: int
    epoch: int
    index: list[int]
    """Sequence indices in the training set."""
    ids: list[str]
    input_ids: torch.Tensor
    """[b, L] right-padded."""
    loss_mask: torch.Tensor
    lengths: torch.Tensor
    features: torch.Tensor | None
    """[b, L, n_layers*H] from the cache (offline); None when computed online."""
    blocks: PackedBlocks
    weight_sum: float
    """Sum of slot weights over labelled slots: the loss normaliser's share of this micro-batch."""


class MicroBatches(torch.utils.data.Dataset):
    """Item k = this process's k-th micro-batch from `start_step` on, collated and packed."""

    def __init__(self, source, schedule: Schedule, rank: int, start_step: int, total_steps: int,
                 num_anchors: int, block_size: int, mask_token_id: int, gamma: float):
        self.source, self.schedule, self.rank = source, schedule, rank
        self.start_step, self.total_steps = start_step, total_steps
        self.num_anchors, self.block_size, self.mask_token_id = num_anchors, block_size, mask_token_id
        self.weights = slot_weights(block_size, gamma).double()

    def __len__(self) -> int:
        return (self.total_steps - self.start_step) * self.schedule.grad_accum

    def __getitem__(self, k: int) -> Batch:
        step, micro = self.start_step + k // self.schedule.grad_accum, k % self.schedule.grad_accum
        epoch, index = self.schedule.micro_batch(step, micro, self.rank)
        items = [self.source[i] for i in index]
        lengths = torch.tensor([it[0].numel() for it in items])
        L = int(lengths.max())
        input_ids = torch.zeros(len(items), L, dtype=torch.long)
        loss_mask = torch.zeros(len(items), L, dtype=torch.bool)
        features = None
        if items[0][2] is not None:
            features = torch.zeros(len(items), L, items[0][2].shape[-1], dtype=items[0][2].dtype)
        anchors = []
        for row, (i, (ids, mask, feats)) in enumerate(zip(index, items)):
            input_ids[row, : ids.numel()], loss_mask[row, : ids.numel()] = ids, mask
            if features is not None:
                features[row, : ids.numel()] = feats
            g = torch.Generator().manual_seed(seed_for(self.schedule.seed, "anchors", epoch, i))
            anchors.append(sample_anchors(mask, self.num_anchors, g))
        blocks = pack_blocks(input_ids, loss_mask, lengths, anchors, self.block_size, self.mask_token_id)
        weight_sum = float((blocks.label_mask.double() * self.weights).sum())
        return Batch(step, micro, epoch, index, [self.source.id_of(i) for i in index], input_ids, loss_mask,
                     lengths, features, blocks, weight_sum)


class CachedSource:
    """Offline: sequences and features from a FeatureCache."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i):
        return self.cache[i]

    def id_of(self, i: int) -> str:
        return self.cache.ids[i]


class SequenceSource:
    """Online: token sequences only; features come from the target in the loop."""

    def __init__(self, sequences):
        self.sequences = sequences

    def __len__(self) -> int:
        return len(self.sequences)

    def __getitem__(self, i):
        s = self.sequences[i]
        return s.input_ids, s.loss_mask, None

    def id_of(self, i: int) -> str:
        return self.sequences[i].id


def add_noise(features: torch.Tensor, cfg: NoiseConfig, n_layers: int, seed: int, epoch: int,
              index: list[int]) -> torch.Tensor:
    """Context features with noise scaled to each token's per-layer RMS; a new tensor (the clean
    features, and everything computed from them, are untouched)."""
    if cfg.kind == "none":
        return features
    b, L, D = features.shape
    x = features.float().view(b, L, n_layers, D // n_layers)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    out = torch.empty_like(x)
    for row, i in enumerate(index):
        g = torch.Generator(device=features.device).manual_seed(seed_for(seed, "noise", epoch, i))
        if cfg.kind == "gaussian":
            out[row] = torch.randn(x.shape[1:], generator=g, device=x.device)
        else:
            out[row] = torch.rand(x.shape[1:], generator=g, device=x.device) * 2 - 1
    return (x + cfg.scale * rms * out).view(b, L, D).to(features.dtype)
