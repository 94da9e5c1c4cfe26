"""Training data: which sequences each process reads at each step, their anchors and noise.

Everything random is seeded from (train.seed, what, epoch, sequence index), never from a
process's RNG stream, so the data a step sees is the same whatever the number of processes,
and a resumed run sees exactly what the uninterrupted run would have seen.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass

import torch

from dflash.config import NoiseConfig
from dflash.drafter.blocks import PackedBlocks, pack_blocks, sample_anchors
from dflash.drafter.loss import label_rows, slot_weights
from dflash.target.features import TopK


def seed_for(*parts) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "little") >> 1


@dataclass
class Schedule:
    """Global batch = batch_size x world x grad_accum sequences per optimizer step; an epoch is
    a seeded permutation of all sequences, its last global batch topped up from its start. With `shares`
    (a mixture: dflash.data.mixture.shares) an epoch of the same length holds each source's share of it
    (`quotas`), drawn from an endless seeded cycle over the source's sequences (an under-weighted source shows
    other sequences each epoch; over whole cycles every sequence of a source comes equally often), then shuffled.

    An epoch's order is built once, on its first micro-batch, and kept until another epoch's is asked for: every
    process and DataLoader worker builds its own (one entry: a worker reads its micro-batches in step order)."""

    num_sequences: int
    batch_size: int
    world: int
    grad_accum: int
    seed: int
    shares: list[tuple[list[int], float]] | None = None
    """Per source: (its sequences' indices, its share of an epoch); None = every sequence once an epoch."""
    _cached: tuple[int, torch.Tensor] | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    """(epoch, its order): the last order built."""

    def __getstate__(self) -> dict:
        # pickled into a DataLoader worker (spawn): the worker builds its epoch's order itself, rather than
        # receiving num_sequences indices it may never read
        return {**self.__dict__, "_cached": None}

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.world * self.grad_accum

    @property
    def steps_per_epoch(self) -> int:
        return max(1, math.ceil(self.num_sequences / self.global_batch))

    def order(self, epoch: int) -> torch.Tensor:
        """[num_sequences] int64: the sequence index at each position of the epoch (built once per epoch)."""
        if self._cached is None or self._cached[0] != epoch:
            self._cached = (epoch, self._build(epoch))
        return self._cached[1]

    def permutation(self, epoch: int) -> list[int]:
        return self.order(epoch).tolist()

    def _build(self, epoch: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed_for(self.seed, "order", epoch))
        if self.shares is None:
            return torch.randperm(self.num_sequences, generator=g)
        picked = []
        for k, ((indices, _), quota) in enumerate(zip(self.shares, self.quotas())):
            if quota == 0:  # a source too light for a sequence this epoch: no cycle to read
                continue
            # source k's epoch is positions start .. start + quota - 1 of its stream, where position pos is
            # cycle pos // n's permutation at pos % n: one randperm per cycle the epoch touches, laid end to end
            start, n = epoch * quota, len(indices)
            cycles = range(start // n, (start + quota - 1) // n + 1)
            stream = torch.cat([torch.randperm(n, generator=torch.Generator().manual_seed(
                seed_for(self.seed, "source", k, c))) for c in cycles])
            offset = start - cycles.start * n
            picked.append(torch.as_tensor(indices, dtype=torch.long)[stream[offset: offset + quota]])
        picked = torch.cat(picked) if picked else torch.zeros(0, dtype=torch.long)
        return picked[torch.randperm(len(picked), generator=g)]

    def quotas(self) -> list[int]:
        """Each source's sequences in an epoch: its share of num_sequences, rounded so that they sum to it
        (largest remainders first)."""
        exact = [share * self.num_sequences for _, share in self.shares]
        counts = [int(x) for x in exact]
        for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: self.num_sequences - sum(counts)]:
            counts[i] += 1
        return counts

    def micro_batch(self, step: int, micro: int, rank: int) -> tuple[int, list[int]]:
        """(epoch, sequence indices) for one process's micro-batch of an optimizer step."""
        epoch, within = divmod(step, self.steps_per_epoch)
        start = within * self.global_batch + (micro * self.world + rank) * self.batch_size
        positions = torch.arange(start, start + self.batch_size) % self.num_sequences
        return epoch, self.order(epoch)[positions].tolist()


def map_tensors(obj, fn):
    """A copy of the dataclass `obj` with `fn` applied to each tensor field (and, recursively, to the tensors of
    each dataclass field); other fields are kept as they are."""
    changes = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if torch.is_tensor(value):
            changes[f.name] = fn(value)
        elif dataclasses.is_dataclass(value):
            changes[f.name] = map_tensors(value, fn)
    return dataclasses.replace(obj, **changes)


@dataclass
class Batch:
    """One process's micro-batch, built on the host (in a DataLoader worker). Its tensors are CPU tensors; the
    numbers the loop needs from it (weight_sum, num_tokens, num_blocks) are Python numbers, computed here, so
    the training step never reads them back from the device."""

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
    """[b, L, n_layers*H] from the cache (offline) in its storage dtype (bfloat16, float32 or float8_e4m3fn), so
    the host-to-device copy moves the stored bytes and the device upcasts; None when computed online."""
    scales: torch.Tensor | None
    """[b, L, n_layers] float32: the per-token scales of float8 features (dflash.data.cache.dequantize); else None."""
    blocks: PackedBlocks
    label_rows: torch.Tensor
    """[N] flat indices of blocks.label_mask's labelled slots (block_loss's rows), found here on the host."""
    weight_sum: float
    """Sum of slot weights over labelled slots: the loss normaliser's share of this micro-batch."""
    num_tokens: int
    """Tokens in the micro-batch (sum of lengths)."""
    num_blocks: int
    """Real (not padding) blocks packed: the anchors sampled."""
    topk: TopK | None = None
    """[b, L, k] (rest [b, L]) the target's stored top-k next-token distributions (offline, from a cache
    extracted with features.topk_logits, for the soft-label losses); else None. Padding positions hold zeros."""

    def pin_memory(self) -> Batch:
        """A copy with every tensor (the packed blocks' too) in page-locked memory: what the DataLoader calls
        with pin_memory=True, since it pins only tensors and objects with this method. Pinned memory is what
        makes the loop's `non_blocking` host-to-device copies asynchronous."""
        return map_tensors(self, lambda t: t.pin_memory())


class MicroBatches(torch.utils.data.Dataset):
    """Item k = this process's k-th micro-batch from `start_step` on, collated and packed."""

    def __init__(self, source, schedule: Schedule, rank: int, start_step: int, total_steps: int,
                 num_anchors: int, block_size: int, mask_token_id: int, gamma: float, topk: bool = False):
        self.source, self.schedule, self.rank = source, schedule, rank
        self.topk = topk  # read the source's stored top-k distributions (soft-label losses offline)
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
        features = scales = None
        if items[0][2] is not None:  # in the stored dtype: the loop upcasts on the device
            features = torch.zeros(len(items), L, items[0][2].shape[-1], dtype=items[0][2].dtype)
        if items[0][3] is not None:  # padding rows get scale 0: their features dequantize to 0, as before
            scales = torch.zeros(len(items), L, items[0][3].shape[-1], dtype=items[0][3].dtype)
        anchors = []
        for row, (i, (ids, mask, feats, feat_scales)) in enumerate(zip(index, items)):
            input_ids[row, : ids.numel()], loss_mask[row, : ids.numel()] = ids, mask
            if features is not None:
                features[row, : ids.numel()] = feats
            if scales is not None:
                scales[row, : ids.numel()] = feat_scales
            g = torch.Generator().manual_seed(seed_for(self.schedule.seed, "anchors", epoch, i))
            anchors.append(sample_anchors(mask, self.num_anchors, g))
        blocks = pack_blocks(input_ids, loss_mask, lengths, anchors, self.block_size, self.mask_token_id)
        weight_sum = float((blocks.label_mask.double() * self.weights).sum())
        return Batch(step, micro, epoch, index, [self.source.id_of(i) for i in index], input_ids, loss_mask,
                     lengths, features, scales, blocks, label_rows(blocks.label_mask), weight_sum,
                     int(lengths.sum()), int(blocks.valid.sum()), topk=self._topk(index, L))

    def _topk(self, index: list[int], L: int) -> TopK | None:
        """The sequences' stored top-k distributions, right-padded to [b, L, k], or None (none stored)."""
        tops = [self.source.topk(i) for i in index] if self.topk else []
        if not tops or tops[0] is None:
            return None
        b, k = len(tops), tops[0].ids.shape[-1]
        out = TopK(torch.zeros(b, L, k), torch.zeros(b, L, k, dtype=torch.long), torch.zeros(b, L))
        for row, t in enumerate(tops):
            n = t.ids.shape[0]
            out.logprobs[row, :n], out.ids[row, :n], out.rest[row, :n] = t.logprobs, t.ids, t.rest
        return out


class CachedSource:
    """Offline: sequences and features from a FeatureCache. source[i] = (input_ids [T], loss_mask [T],
    features [T, n_layers*H] in the storage dtype, float8 scales [T, n_layers] or None)."""

    def __init__(self, cache):
        self.cache = cache

    def __len__(self) -> int:
        return len(self.cache)

    def __getitem__(self, i):
        return self.cache.stored(i)

    def topk(self, i: int):
        """Sequence i's stored top-k next-token distribution (TopK [T, k]), or None."""
        return self.cache.topk(i)

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
        return s.input_ids, s.loss_mask, None, None

    def topk(self, i: int):
        return None  # online: the loop has the target's full logits

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
