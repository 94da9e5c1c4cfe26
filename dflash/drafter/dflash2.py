"""DFlash 2's two parts (DESIGN §2b): the grouped dynamic causal convolution and the candidate selector.

The drafter model (dflash.drafter.model) switches them on when its config carries the DFlash 2 keys
(`dflash_config.conv_kernel_size` ...); this module holds the parts and their pure functions. Like the
model module it imports torch only, and is copied beside it into every export (trust_remote_code loads).

Convolution: two per decoder layer, around the attention and around the MLP, inside the residual
branch after the layer's norm. On the sublayer's input x [b, q, H] a projection gives dynamic taps
d [b, q, 2, k, G] (G = H / group_size groups, one tap per group shared by its channels); before the
sublayer x' = conv(x, base[0], d[:, :, 0]), after it y' = conv(y, base[1], d[:, :, 1]) with

    conv(z, b, d)[t] = sum_{o < k} (b[o] + d[t, o, group]) * z[t - o]

per channel, and z[t - o] = 0 before the first slot of t's block: one-block inference never sees
another block, so the packed training forward cuts its queries into blocks and zeroes those taps at
each block start. Identity init (b[.., 0] = 1, the rest 0, projection 0) makes a fresh DFlash 2
layer compute exactly the DFlash layer.

Selector: on the block's output hidden states h of the drafted slots, the target head's logits give
the unary scores; the K best are the candidates, and candidate c after predecessor token a scores

    score(c | a) = unary(c) + sum_r P[a, r] (W h)[r] S[c, r]

(P, S: [V, r] codebooks; W: H -> r). Slot 1's predecessor is the anchor token, each next slot's the
token chosen before it. Temperature 0 takes the argmax; T > 0 samples from softmax(score / T) over
the K candidates (zero off them), the draft distribution rejection sampling verifies against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
"""dflash_config keys of a DFlash 2 drafter (their presence makes a config DFlash 2)."""


def grouped_dynamic_conv(z: torch.Tensor, base: torch.Tensor, dynamic: torch.Tensor, group_size: int,
                         block_len: int) -> torch.Tensor:
    """The grouped dynamic causal convolution of z [b, q, H], blocks of `block_len` queries apart.

    base: [k, H] static taps per channel; dynamic: [b, q, k, G] taps per group (G = H / group_size).
    q must be a multiple of block_len (packed blocks) or at most block_len (one, maybe partial, block).
    Returns [b, q, H]; a tap reaching before its block's first slot reads 0.
    """
    b, q, H = z.shape
    k, groups = base.shape[0], H // group_size
    block_len = min(block_len, q)
    if q % block_len:
        raise ValueError(f"{q} queries are not whole blocks of {block_len}")
    n = q // block_len
    blocks = z.reshape(b, n, block_len, groups, group_size)
    taps = dynamic.reshape(b, n, block_len, k, groups, 1).to(z.dtype)
    return _BlockConv.apply(blocks, base.reshape(k, groups, group_size).to(z.dtype), taps).reshape(b, q, H)


class _BlockConv(torch.autograd.Function):
    """out[t] = sum_o (base[o] + taps[t, o]) * z[t - o] within each block, with its gradients written out.

    z [b, n, L, G, gs] (n blocks of L), base [k, G, gs], taps [b, n, L, k, G, 1]. Autograd through shifted
    slices and padding allocated and zero-filled a full-size tensor per shift in both passes (1.3x the DFlash
    training step on the CPU benchmark); here each pass accumulates into its outputs in place.
    """

    @staticmethod
    def forward(ctx, z, base, taps):
        L, k = z.shape[2], base.shape[0]
        out = z * (base[0] + taps[:, :, :, 0])
        for o in range(1, min(k, L)):  # taps past the block's start read zeros: those slots get nothing
            out[:, :, o:] += z[:, :, :-o] * (base[o] + taps[:, :, o:, o])
        ctx.save_for_backward(z, base, taps)
        return out

    @staticmethod
    def backward(ctx, grad):
        z, base, taps = ctx.saved_tensors
        L, k = z.shape[2], base.shape[0]
        grad_z = grad * (base[0] + taps[:, :, :, 0])
        grad_base = torch.zeros_like(base)
        grad_taps = torch.zeros_like(taps)
        for o in range(min(k, L)):
            g, zs = (grad, z) if o == 0 else (grad[:, :, o:], z[:, :, :-o])
            if o:
                grad_z[:, :, :-o] += g * (base[o] + taps[:, :, o:, o])
            prod = g * zs
            grad_base[o] = prod.sum((0, 1, 2))
            grad_taps[:, :, o:, o] = prod.sum(-1, keepdim=True)
        return grad_z, grad_base, grad_taps


class GroupedDynamicConv(nn.Module):
    """`base_kernel` [2, k, H] and `kernel_projection` H -> 2 k G, the published names."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size={group_size} does not divide the hidden size {hidden_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(identity_kernel(kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        nn.init.zeros_(self.kernel_projection.weight)
        self.conv = grouped_dynamic_conv  # training may put a fused kernel of the same signature here

    def prepare(self, x: torch.Tensor, block_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """x [b, q, H] -> (x convolved before the sublayer, the taps `finish` applies after it)."""
        taps = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return (self.conv(x, self.base_kernel[0], taps[..., 0, :, :], self.group_size, block_len),
                taps[..., 1, :, :])

    def finish(self, y: torch.Tensor, taps: torch.Tensor, block_len: int) -> torch.Tensor:
        return self.conv(y, self.base_kernel[1], taps, self.group_size, block_len)


def identity_kernel(kernel_size: int, hidden_size: int) -> torch.Tensor:
    """[2, k, H]: tap 0 is 1, the others 0 (with a zero projection the convolution is the identity)."""
    base = torch.zeros(2, kernel_size, hidden_size)
    base[:, 0] = 1.0
    return base


class CandidateSelector(nn.Module):
    """`predecessor_codebook` / `successor_codebook` [V, r] (stored without `.weight`, as published) and
    `hidden_projection` H -> r."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int):
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        nn.init.normal_(self.predecessor_codebook, std=0.02)
        nn.init.normal_(self.successor_codebook, std=0.02)

    def candidates(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V] -> (unary scores [..., K], candidate ids [..., K]), best first."""
        return torch.topk(logits, min(self.top_k, logits.shape[-1]), dim=-1)

    def pairwise(self, hidden: torch.Tensor, prev: torch.Tensor, cand: torch.Tensor,
                 dropout: float = 0.0) -> torch.Tensor:
        """sum_r P[prev, r] (W h)[r] S[cand, r]: hidden [..., H], prev [...], cand [..., K] -> [..., K]. dropout:
        on the predecessor's row P[prev], a regulariser of training only (loss.selector.dropout; decoding has 0)."""
        grad = torch.is_grad_enabled()  # without gradients (decoding) no autograd Function's overhead
        P = self.predecessor_codebook
        pred = _CodebookRows.apply(P, prev) if grad else F.embedding(prev, P)
        mixed = (F.dropout(pred, dropout) if dropout > 0 else pred) * self.hidden_projection(hidden)
        if not grad:
            return (F.embedding(cand, self.successor_codebook).to(mixed.dtype) @ mixed.unsqueeze(-1)).squeeze(-1)
        return _PairScores.apply(mixed.expand(*cand.shape[:-1], mixed.shape[-1]), self.successor_codebook, cand)

    def scores(self, hidden: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor,
               prev: torch.Tensor, dropout: float = 0.0) -> torch.Tensor:
        """Each candidate's score after the given predecessor tokens: [..., K] (prev [...]; dropout: `pairwise`)."""
        return unary.float() + self.pairwise(hidden, prev, cand, dropout).float()

    def transitions(self, hidden: torch.Tensor, unary: torch.Tensor, cand: torch.Tensor,
                    anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every score the selector's walk can meet, from one batched product.

        hidden [b, S, H], unary/cand [b, S, K] of the S drafted slots, anchor [b]. Returns
        (first [b, K]: slot 1's scores after the anchor, table [b, S-1, K, K]: table[:, s, i, j] = score of
        candidate j at slot s+2 after candidate i of slot s+1). A predecessor inside the walk is always a
        candidate of the slot before, so these are all the walk (greedy or sampled) and a tree read.
        """
        first = self.scores(hidden[:, 0], unary[:, 0], cand[:, 0], anchor)
        if cand.shape[1] < 2:
            return first, unary.new_zeros(cand.shape[0], 0, cand.shape[2], cand.shape[2]).float()
        mixed = F.embedding(cand[:, :-1], self.predecessor_codebook) * self.hidden_projection(hidden[:, 1:])[:, :, None]
        pair = torch.einsum("bsir,bsjr->bsij", mixed, F.embedding(cand[:, 1:], self.successor_codebook).to(mixed.dtype))
        return first, unary[:, 1:, None, :].float() + pair.float()


ROW_BY_ROW_MIN = 2**18
"""The gathered block (n K r values) from which `_row_by_row` reads a candidate at a time on CPU: 1 MiB of float32,
about what a core's cache holds."""


def _row_by_row(device: torch.device, block: int) -> bool:
    """The selector's candidate rows a candidate at a time (CPU, a gathered block of `block` = n K r values at least
    ROW_BY_ROW_MIN), or gathered all at once (smaller blocks, and other devices).

    On CPU a gathered [n, K, r] block of codebook rows larger than the cache is memory traffic that dominates the
    selector (at the 3840 rows a step of bench dflash2's toy shape: the gather and its product 32 ms, their
    gradients 50 ms; a candidate at a time, each [n, r] slice staying in cache: 5 and 4 ms). A small block (a few
    rows) stays in cache gathered, and there a loop of K reads is K times the per-call overhead (in decoding's
    one-row call, before decoding skipped these Functions: 0.5 ms of the selector walk's 0.9 at K = 16, bench
    dflash2's Qwen3-8B shape). A GPU has the bandwidth, and one gather is 3 kernels where a loop is 3K."""
    return device.type == "cpu" and block >= ROW_BY_ROW_MIN


def _scatter_rows(grad: torch.Tensor, index: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A codebook's gradient [num_rows, r] from its gathered rows' gradients grad [n, r] (index [n]): on CPU an
    index_add_ (embedding's dense backward sorts the indices first: 1.4x the time on 30k rows); elsewhere
    embedding's backward, deterministic on CUDA where index_add_ is not."""
    if grad.device.type == "cpu":
        return grad.new_zeros(num_rows, grad.shape[-1]).index_add_(0, index, grad)
    return torch.ops.aten.embedding_dense_backward(grad, index, num_rows, -1, False)


class _CodebookRows(torch.autograd.Function):
    """F.embedding(index, codebook) [..., r] with `_scatter_rows` as its backward."""

    @staticmethod
    def forward(ctx, codebook, index):
        ctx.save_for_backward(index)
        ctx.num_rows = codebook.shape[0]
        return codebook.index_select(0, index.reshape(-1)).view(*index.shape, codebook.shape[1])

    @staticmethod
    def backward(ctx, grad):
        (index,) = ctx.saved_tensors
        rows = _scatter_rows(grad.reshape(-1, grad.shape[-1]), index.reshape(-1), ctx.num_rows)
        return rows, None


class _PairScores(torch.autograd.Function):
    """sum_r mixed[..., r] S[cand[..., k], r]: mixed [..., r], codebook S [V, r], cand [..., K] -> [..., K], in
    mixed's dtype, with its gradients written out (`_row_by_row` says how the rows are read). The gradient of mixed,
    sum_k g[k] S[cand[k]], is embedding_bag's weighted sum: no [n, K, r] block in either case. Autograd through
    F.embedding and einsum made that block four times (the rows, their gradient as a batched outer product, its
    transpose, embedding's backward)."""

    @staticmethod
    def forward(ctx, mixed, codebook, cand):
        lead, K, r = cand.shape[:-1], cand.shape[-1], codebook.shape[1]
        flat, m = cand.reshape(-1, K), mixed.reshape(-1, r)
        ctx.save_for_backward(m, codebook, flat)
        ctx.lead, ctx.row_by_row = lead, _row_by_row(m.device, flat.numel() * r)
        if ctx.row_by_row:
            out = torch.stack([(codebook.index_select(0, flat[:, k]).to(m.dtype) * m).sum(-1) for k in range(K)], 1)
        else:
            rows = codebook.index_select(0, flat.reshape(-1)).view(-1, K, r).to(m.dtype)
            out = torch.bmm(rows, m.unsqueeze(-1)).squeeze(-1)
        return out.view(*lead, K)

    @staticmethod
    def backward(ctx, grad):
        m, codebook, flat = ctx.saved_tensors
        K, r = flat.shape[1], m.shape[1]
        g = grad.reshape(-1, K)
        grad_mixed = grad_codebook = None
        if ctx.needs_input_grad[0]:
            table = codebook if codebook.dtype == m.dtype else codebook.to(m.dtype)
            grad_mixed = F.embedding_bag(flat, table, mode="sum", per_sample_weights=g.to(m.dtype))
            grad_mixed = grad_mixed.view(*ctx.lead, r)
        if ctx.needs_input_grad[1]:
            g = g.to(m.dtype)
            if ctx.row_by_row:
                grad_codebook = torch.zeros(codebook.shape, dtype=m.dtype, device=m.device)
                for k in range(K):
                    grad_codebook.index_add_(0, flat[:, k], g[:, k, None] * m)
            else:
                outer = (g.unsqueeze(-1) * m.unsqueeze(1)).view(-1, r)
                grad_codebook = _scatter_rows(outer, flat.reshape(-1), codebook.shape[0])
            grad_codebook = grad_codebook.to(codebook.dtype)
        return grad_mixed, grad_codebook, None


def walk_path(cand: torch.Tensor, first: torch.Tensor, table: torch.Tensor, depth: int | None = None,
              draw=None) -> list[int]:
    """The selector's path for one block: its tokens.

    cand [S, K], first [K], table [S-1, K, K] (one block of `selector_tables`); depth: slots to walk (default
    all S). Without `draw` it takes the best candidate (temperature 0) and reads its argmax table back once: no
    per-slot sync. draw(scores [K], slot) -> index samples a candidate from the slot's scores (the caller
    applies the sampling transform, dflash.drafter.decoding.sampling, and keeps the distribution it drew from).
    """
    S = cand.shape[0] if depth is None else min(depth, cand.shape[0])
    if S <= 0:
        return []
    if draw is None:
        best_first, best = int(first.argmax()), table.argmax(-1).tolist()  # [S-1][K]: next index after index i
        idx = [best_first]
        for s in range(S - 1):
            idx.append(best[s][idx[-1]])
    else:
        idx, row = [], first
        for s in range(S):
            idx.append(int(draw(row, s)))
            if s + 1 < S:
                row = table[s, idx[-1]]
    return cand[torch.arange(S), torch.tensor(idx, device=cand.device)].tolist()


def beam_path(cand: torch.Tensor, first: torch.Tensor, table: torch.Tensor, depth: int | None = None,
              width: int = 4) -> list[int]:
    """The selector's chain for one block chosen by a beam over its pairwise scores: of the paths through the
    slots' candidates, the one with the largest expected accepted length under the selector's own probabilities,
    sum_k prod_{i<=k} q_i (q_i the softmax of slot i's scores after the path's token at slot i-1), searched `width`
    paths at a time. Width 1 is the greedy walk (`walk_path`: the largest q at each slot also grows that sum the
    most); a wider beam may give up a likelier first slot for a path whose later slots hold up.

    cand [S, K], first [K], table [S-1, K, K] (one block of `selector_tables`, raw or log-softmaxed scores: only
    their softmax is read); depth: slots to draft (default all S)."""
    S = cand.shape[0] if depth is None else min(depth, cand.shape[0])
    if S <= 0:
        return []
    K = cand.shape[1]
    reach = torch.softmax(first.float(), -1)  # P(the path's first k slots all right), per candidate
    order = reach.argsort(descending=True, stable=True)[:width]
    paths, reach = order[:, None], reach[order]
    expected = reach.clone()
    step = torch.softmax(table.float(), -1)  # [S-1, K, K]: q of each candidate after each previous candidate
    for s in range(1, S):
        grown = reach[:, None] * step[s - 1][paths[:, -1]]  # [W, K]
        score = (expected[:, None] + grown).flatten()
        keep = score.argsort(descending=True, stable=True)[:width]
        paths = torch.cat([paths[keep // K], (keep % K)[:, None]], 1)
        reach, expected = grown.flatten()[keep], score[keep]
    return cand[torch.arange(S, device=cand.device), paths[0]].tolist()


def selector_tables(selector: CandidateSelector, hidden: torch.Tensor, logits: torch.Tensor,
                    anchor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(candidates [b, S, K], first [b, K], table [b, S-1, K, K]) of blocks' drafted slots: hidden [b, S, H],
    logits [b, S, V] (the target head's, the unary scores), anchor [b] (`CandidateSelector.transitions`)."""
    unary, cand = selector.candidates(logits)
    first, table = selector.transitions(hidden, unary, cand, anchor)
    return cand, first, table
