"""The one function that computes target features.

extract.py, online training, teacher-forced evaluation and live decoding all call
`target_forward`, so the layers, the concatenation order, the dtype and the kernels that
produced a drafter's training features are the ones it is evaluated and served with.
Features of layer l are the output of decoder layer l (HF `output_hidden_states[l + 1]`;
for the last layer that is after the final norm, as HF reports it).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from dflash.errors import TargetError
from dflash.target.loading import Target
from dflash.target.sharding import shared


@dataclass
class TargetOutput:
    features: torch.Tensor | None
    """[b, L, len(layer_ids) * H] concatenated layer outputs, in layer_ids order (None for no layers)."""
    logits: torch.Tensor | None
    """[b, kept, vocab] when logits were asked for."""


def _cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` during 5.x; accept both."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _output_tensor(out):
    return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def target_forward(target: Target, input_ids: torch.Tensor, layer_ids: list[int], *,
                   attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None,
                   cache=None, logits_to_keep: int | None = None) -> TargetOutput:
    """Run the target once; keep only the requested layers' outputs.

    input_ids: [b, L]. attention_mask: [b, L] (1 = token, 0 = padding) or per-layer-type 4D masks; None for
    right padding, which needs none: a causal target's outputs at a row's real positions never see the padding
    after them, while a [b, L] mask makes transformers build a dense [b, 1, L, L] one (sdpa, eager: 1 GiB a
    sequence of 32k tokens, and a float copy for every layer's call). cache: a
    transformers cache for incremental decoding. logits_to_keep: None (no logits needed; only
    the last position's are computed), 0 (all positions) or k (the last k).
    A target sharded over processes (target.tensor_parallel) runs the call with the other processes of its group
    (dflash.target.sharding.shared): each process passes its own inputs and gets its own outputs.
    """
    if getattr(target, "tp", None) is None:
        return _forward(target, input_ids, layer_ids, attention_mask, position_ids, cache, logits_to_keep)
    if cache is not None:
        raise TargetError("decoding token by token with a cache (live evaluation, plain decoding) runs the target on "
                          "one process: a tensor-parallel target (target.tensor_parallel > 1) extracts and trains "
                          "only. Evaluate live with target.tensor_parallel=1 (target.device_map=auto places a "
                          "target bigger than one GPU over several), or serve the drafter with vLLM")
    cpu = lambda t: t.cpu() if isinstance(t, torch.Tensor) else t  # noqa: E731  (inputs travel to the group by value)
    return shared(target, _forward, cpu(input_ids), layer_ids, cpu(attention_mask), cpu(position_ids), None,
                  logits_to_keep)


def _forward(target: Target, input_ids, layer_ids, attention_mask, position_ids, cache, logits_to_keep) -> TargetOutput:
    device = target.device
    to = lambda t: t.to(device) if isinstance(t, torch.Tensor) else t  # noqa: E731  (a dict of masks stays as given)
    captured: dict[int, torch.Tensor] = {}
    hooks = []
    last = target.num_layers - 1
    for layer_id in set(layer_ids):
        module = target.final_norm if layer_id == last else target.layers[layer_id]
        hooks.append(module.register_forward_hook(
            lambda _m, _i, out, layer_id=layer_id: captured.__setitem__(layer_id, _output_tensor(out))))
    kwargs = {"use_cache": cache is not None}
    if cache is not None:
        kwargs[_cache_kwarg(target.model)] = cache
    try:
        out = target.model(input_ids=to(input_ids), attention_mask=to(attention_mask), position_ids=to(position_ids),
                           logits_to_keep=1 if logits_to_keep is None else logits_to_keep, **kwargs)
    finally:
        for h in hooks:
            h.remove()
    # layers placed over several GPUs (target.device_map) leave their outputs where they ran
    features = torch.cat([captured[i].to(device) for i in layer_ids], dim=-1) if layer_ids else None
    return TargetOutput(features=features, logits=None if logits_to_keep is None else out.logits.to(device))


@dataclass
class TopK:
    """The target's next-token distribution at each position, reduced to its k most likely tokens."""

    logprobs: torch.Tensor
    """[..., k] float32 log-probabilities of the k tokens (descending)."""
    ids: torch.Tensor
    """[..., k] their token ids."""
    rest: torch.Tensor
    """[...] float32 probability mass of every other token, 1 - sum(exp(logprobs)), at least 0."""


def topk_of(logits: torch.Tensor, k: int) -> TopK:
    """TopK of logits [..., vocab] (softmax over the whole vocabulary, then its k largest)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    rest = (1 - values.exp().sum(-1)).clamp_min(0)
    if k >= logp.shape[-1]:  # nothing is left out: not the rounding residue of the sum, which the loss would
        rest = torch.zeros_like(rest)  # weigh against the drafter's (empty) remainder
    return TopK(values, ids, rest)


def batched_features(target: Target, sequences: list[torch.Tensor], layer_ids: list[int],
                     batch_tokens: int, topk: int = 0) -> Iterator[tuple[int, torch.Tensor, TopK | None]]:
    """Features of many sequences, in right-padded batches of at most `batch_tokens` tokens.

    Yields (index into `sequences`, features [L_i, n*H] on the target's device, TopK [L_i, k] of the
    target's next-token distribution at each position when topk = k > 0, else None), longest
    sequences first (similar lengths share a batch, so little compute goes to padding).
    """
    order = sorted(range(len(sequences)), key=lambda i: -sequences[i].numel())
    batch: list[int] = []

    def run(batch):
        width = sequences[batch[0]].numel()
        ids = torch.full((len(batch), width), target.tokenizer.pad_token_id or 0, dtype=torch.long)
        for row, i in enumerate(batch):
            ids[row, : sequences[i].numel()] = sequences[i]
        # right padding, so no attention mask (target_forward): nothing [L, L]-sized for a long batch
        out = target_forward(target, ids.to(target.device), layer_ids, logits_to_keep=0 if topk else None)
        soft = topk_of(out.logits, topk) if topk else None
        for row, i in enumerate(batch):
            n = sequences[i].numel()
            yield i, out.features[row, :n], (TopK(soft.logprobs[row, :n], soft.ids[row, :n], soft.rest[row, :n])
                                             if soft else None)

    for i in order:
        width = sequences[batch[0]].numel() if batch else sequences[i].numel()
        if batch and width * (len(batch) + 1) > batch_tokens:
            yield from run(batch)
            batch = []
        batch.append(i)
    if batch:
        yield from run(batch)
