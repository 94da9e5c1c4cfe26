"""The verification rule of live decoding: which token the target commits at a position, and which drafted
token it accepts there. One rule per decoding run, shared by the chain, the DDTree and DFlash 2's selector.

- `Greedy` (temperature 0): the target's argmax; a draft is accepted when it equals it.
- `Rejection` (temperature > 0, the default; speculative sampling, Leviathan et al. 2023 / Chen et al. 2023):
  a draft x drawn from the drafter's q is accepted with probability min(1, p(x) / q(x)), p the target's
  distribution after the same sampling transform (dflash.drafter.decoding.sampling); on rejection the token comes from
  the residual max(p - q, 0), renormalised, and after the last accepted draft the bonus token from p. The
  committed token is then distributed exactly as p: lossless, and a slot accepts with probability
  sum_x min(p(x), q(x)). At a tree node the children are tried in order, as in SpecInfer's multi-draft
  verification (recursive rejection sampling: after each rejection p becomes the residual of that child's q).
  A DDTree's children are chosen, not sampled: each is a draft whose q is one at its token, so a rejection
  zeroes that token, and a node accepts one of its children with probability p(children), the most any
  lossless verifier can accept from fixed tokens.
- `exact_match` (temperature > 0): greedy drafts (the drafter's argmax, DFlash 2's best selector walk) under the
  rejection rule with q one at each draft, i.e. accepted when they equal a sample of p, as the reference
  decoder's benchmark measured its temperature-1 tables (z-lab/dflash benchmark.py @ bb48ef9); a draft d is
  accepted with probability p(d), at most max p, below rejection sampling's sum_x min(p, q) for a drafter
  whose q is close to p.
- `SeededMatch` (temperature > 0, `verifier=seeded`): the target draws its own token at absolute position t
  from a generator seeded by (seed, t), as plain decoding does (`plain_sample`), and a draft is accepted when it
  equals that draw. Lossless and token for token equal to plain decoding with the same seed (what tests
  compare), but it accepts a draft only with probability p(x), less than rejection sampling.
"""

from __future__ import annotations

import hashlib

import torch

from dflash.drafter.decoding.sampling import Sampling, probs

VERIFIERS = ("rejection", "seeded", "exact_match")


def _position_seed(seed: int, position: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest(), "little") >> 1


def seeded_draw(p: torch.Tensor, seed: int, position: int) -> int:
    """An index drawn from the distribution p [n] by the generator of (seed, position)."""
    g = torch.Generator(device=p.device).manual_seed(_position_seed(seed, position))
    return int(torch.multinomial(p, 1, generator=g))


def plain_sample(logits: torch.Tensor, sampling: Sampling, seed: int, first_position: int) -> list[int]:
    """Plain decoding's token for each row of logits [n, V], row i at absolute position first_position + i:
    the argmax at temperature 0, else a draw from the transformed distribution by the generator of (seed,
    position)."""
    if sampling.greedy:
        return logits.argmax(-1).tolist()
    p = probs(logits, sampling)
    return [seeded_draw(p[i], seed, first_position + i) for i in range(p.shape[0])]


class Rule:
    """A verification rule, and how the drafts it verifies are made. Positions are absolute (the committed
    text's length at that token)."""

    greedy_drafts = True
    """Drafts are the drafter's argmax (DFlash 2: its best selector walk), not drawn."""
    reads_q = False
    """`chain` needs the distributions the drafts were drawn from."""

    def __init__(self, sampling: Sampling):
        self.sampling = sampling

    def draw_drafts(self, q: torch.Tensor, first_position: int) -> list[int]:
        """One draft from each row of q [n, V], row i the draft at absolute position first_position + i (rules
        whose drafts are drawn)."""
        raise NotImplementedError

    def sample(self, logits: torch.Tensor, position: int) -> int:
        """The target's token from one row of logits [V] where nothing was drafted (the prefill's token)."""
        raise NotImplementedError

    def chain(self, logits: torch.Tensor, position: int, drafts: list[int],
              q: torch.Tensor | None) -> tuple[int, int]:
        """(accepted drafts a, the token committed after them) for drafts d_1..d_m at positions position..+m-1:
        logits [m + 1, V], row i the target's prediction for position + i; q [m, V] the distributions the
        drafts were drawn from (None: chosen, not drawn)."""
        raise NotImplementedError

    def node(self, logits: torch.Tensor, position: int, children: list[int]) -> tuple[int, int]:
        """(index of the accepted child or -1, the committed token) at a tree node whose children hold the
        given tokens (chosen, not drawn), logits [V] the target's prediction there."""
        raise NotImplementedError


class _Deterministic(Rule):
    """The target's token does not depend on the drafts; a draft is accepted when it is that token."""

    def tokens(self, logits: torch.Tensor, position: int) -> list[int]:
        raise NotImplementedError

    def sample(self, logits, position):
        return self.tokens(logits[None], position)[0]

    def chain(self, logits, position, drafts, q):
        post = self.tokens(logits, position)
        a = 0
        while a < len(drafts) and drafts[a] == post[a]:
            a += 1
        return a, post[a]

    def node(self, logits, position, children):
        token = self.tokens(logits[None], position)[0]
        return (children.index(token) if token in children else -1), token


class Greedy(_Deterministic):
    def tokens(self, logits, position):
        return logits.argmax(-1).tolist()


class SeededMatch(_Deterministic):
    greedy_drafts = False

    def __init__(self, sampling: Sampling, seed: int):
        super().__init__(sampling)
        self.seed = seed

    def tokens(self, logits, position):
        return plain_sample(logits, self.sampling, self.seed, position)

    def draw_drafts(self, q, first_position):
        # the generator of (seed + 1, position): drafts reproducible apart from the target's own draws
        return [seeded_draw(q[i], self.seed + 1, first_position + i) for i in range(q.shape[0])]


class Rejection(Rule):
    reads_q = True

    def __init__(self, sampling: Sampling, generator: torch.Generator, greedy_drafts: bool = False):
        super().__init__(sampling)
        self.generator = generator
        self.greedy_drafts = greedy_drafts  # verifier exact_match: argmax drafts, verified with q = 1 at each

    def _draw(self, p: torch.Tensor) -> int:
        return int(torch.multinomial(p, 1, generator=self.generator))

    def draw_drafts(self, q, first_position):
        return torch.multinomial(q, 1, generator=self.generator)[:, 0].tolist()

    def sample(self, logits, position):
        return self._draw(probs(logits, self.sampling))

    def chain(self, logits, position, drafts, q):
        p = probs(logits, self.sampling)
        m = len(drafts)
        if m == 0:
            return 0, self._draw(p[0])
        d = torch.tensor(drafts, device=p.device)
        if q is None:
            q = torch.zeros_like(p[:m]).scatter_(-1, d[:, None], 1.0)
        rows = torch.arange(m, device=p.device)
        u = torch.rand(m, generator=self.generator, device=p.device)
        # accept d_i when u_i < p(d_i) / q(d_i), written without the division
        accept = (u * q[rows, d] < p[rows, d]).tolist()
        a = accept.index(False) if False in accept else m
        if a == m:
            return m, self._draw(p[m])
        return a, self._draw(_residual(p[a], q[a]))

    def node(self, logits, position, children):
        r = probs(logits, self.sampling)
        for i, c in enumerate(children):
            # a chosen child is a draft with q = 1 at its token: accepted with probability r(c), else zeroed
            if float(torch.rand(1, generator=self.generator, device=r.device)) < float(r[c]):
                return i, c
            r = r.clone()
            r[c] = 0.0
            total = r.sum()
            if float(total) <= 1e-12:  # the children held all of p: only floating-point leftovers rejected c
                return i, c
            r = r / total
        return -1, self._draw(r)


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """max(p - q, 0) renormalised: what the target draws after rejecting a draft from q. It is empty only when
    p = q, where nothing is ever rejected; floating-point leftovers then fall back to p."""
    r = (p - q).clamp_min(0)
    total = r.sum()
    return r / total if float(total) > 1e-12 else p


def make_rule(sampling: Sampling, verifier: str = "rejection", seed: int = 0,
              device: torch.device | str = "cpu") -> Rule:
    """The rule of one decoding run: Greedy at temperature 0, else `verifier` (rejection, seeded or exact_match)."""
    if verifier not in VERIFIERS:
        raise ValueError(f"verifier={verifier!r}: rejection (speculative sampling), seeded (exact match of seeded "
                         f"draws, equal to plain decoding token for token) or exact_match (greedy drafts accepted "
                         f"when they equal the target's sample)")
    if sampling.greedy:
        return Greedy(sampling)
    if verifier == "seeded":
        return SeededMatch(sampling, seed)
    generator = torch.Generator(device=device).manual_seed(seed)
    return Rejection(sampling, generator, greedy_drafts=verifier == "exact_match")
