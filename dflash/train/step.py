"""One optimizer step of the training loop (`train_step`), and the sums it leaves for the log line.

What a step costs the host, on CUDA, outside the log and checkpoint steps:
- gradients are reduced once, in the last micro-batch's backward; the others run forward and backward inside
  accelerate's `no_sync` (DDP reads its flag in the forward, FSDP2 in the backward: both run inside it);
- one collective before the forwards, the step's global weight sum (exact loss normalisation), queued on the
  device from a host number, and no read-back: the scale it gives stays a device tensor;
- one read-back after the backwards: a flag of non-finite loss or gradient norm, summed over processes (one
  all_reduce), checked before the update; which micro-batch it was is found afterwards, from the per-micro-batch
  losses kept on the device;
- the window's sums (loss, slot counts, weight, grad norm) stay on the device until a log line reads them
  (`window_totals`: one all_reduce and one copy to the host).
Batches come from the host with their numbers computed there (dflash.train.batches) and are moved with
non_blocking copies: asynchronous from the pinned memory the DataLoader gives on CUDA (Batch.pin_memory), where
a blocking copy would wait for the device's queue. Cached features travel in their storage dtype (bf16, fp8)
and are upcast on the device.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from dflash.data.cache import dequantize
from dflash.drafter import metrics
from dflash.drafter.blocks import draft_packed
from dflash.drafter.loss import block_loss
from dflash.errors import TrainingError
from dflash.target.features import target_forward
from dflash.train.batches import Batch, add_noise, map_tensors


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`t` on `device` without waiting: a blocking host-to-device copy waits for the device's queue."""
    return t.to(device, non_blocking=True)


def batch_features(acc, target, drafter, batch: Batch) -> torch.Tensor:
    """Context features of a micro-batch on the device, float32 [b, L, n_layers*H]: cached ones moved in their
    storage dtype and dequantized there (dflash.data.cache.dequantize, as the cache's own reads do), or
    (online) the target's, computed now."""
    n_layers = len(drafter.target_layer_ids)
    if batch.features is not None:
        stored = to_device(batch.features, acc.device)
        b, L, D = stored.shape
        scales = None if batch.scales is None else to_device(batch.scales, acc.device).view(b * L, n_layers)
        return dequantize(stored.view(b * L, D), scales, n_layers, torch.float32).view(b, L, D)
    ids = to_device(batch.input_ids, acc.device)
    b, L = ids.shape
    mask = None
    if batch.num_tokens < b * L:  # a row is padded (known on the host, nothing read back)
        lengths = to_device(batch.lengths, acc.device)
        mask = (torch.arange(L, device=acc.device)[None] < lengths[:, None]).long()
    return target_forward(target, ids, drafter.target_layer_ids, attention_mask=mask).features.float()


def global_weight(acc, micro: list[Batch]) -> torch.Tensor:
    """The step's loss normaliser: the slot weights of all its micro-batches on all processes, a float64 scalar
    on the device. Each batch's share is a host number; their sum is copied without waiting and all_reduced on
    the device, queued before the forwards, and only the first backward's scaling waits for it. (A reduce on
    the host would need a gloo group beside NCCL, and a read-back, `.item()`, would wait for the device.)"""
    local = torch.tensor(sum(b.weight_sum for b in micro), dtype=torch.float64)
    local = to_device(local.pin_memory() if acc.device.type == "cuda" else local, acc.device)
    return acc.reduce(local, reduction="sum") if acc.num_processes > 1 else local


def train_step(job, acc, m, target, micro: list[Batch], state, gamma: float, backend: str, run) -> None:
    """One optimizer step over `micro` (grad_accum micro-batches of loop.Model `m`); its sums go into
    state.window, as device tensors. Host syncs and collectives: see this module's docstring."""
    dev = acc.device
    total_w = global_weight(acc, micro)
    scale = acc.num_processes / total_w.clamp_min(1e-12)  # DDP averages gradients over processes
    window, n_layers = state.window, len(m.drafter.target_layer_ids)
    losses = []  # per micro-batch, on the device: which one was non-finite is found after the check
    for i, batch in enumerate(micro):
        blocks = map_tensors(batch.blocks, lambda t: to_device(t, dev))
        clean = batch_features(acc, target, m.drafter, batch)
        noised = add_noise(clean, job.noise, n_layers, job.train.seed, batch.epoch, batch.index)
        # the backward inside no_sync too: FSDP2 reads the flag there (DDP in the forward)
        with acc.no_sync(m.model) if i < len(micro) - 1 else nullcontext():
            with acc.autocast():
                hidden = draft_packed(m.drafter, target.embed_tokens, noised, blocks, backend, model=m.model,
                                      num_blocks=job.train.num_anchors)
                loss_sum, _, pred = block_loss(hidden, target.lm_head.weight, blocks.labels, blocks.label_mask,
                                               gamma, job.loss.chunk_logits, rows=to_device(batch.label_rows, dev))
            acc.backward(loss_sum * scale)
        losses.append(loss_sum.detach())
        window["loss_sum"] = window.get("loss_sum", 0.0) + losses[-1].double()
        window["counts"] = metrics.add(window.get("counts"), metrics.count(pred, blocks.labels, blocks.label_mask))
        window["tokens"] = window.get("tokens", 0) + batch.num_tokens
        window["anchors"] = window.get("anchors", 0) + batch.num_blocks
    window["weight"] = window.get("weight", 0.0) + total_w  # global: all processes and micro-batches
    grad_norm = acc.clip_grad_norm_(m.model.parameters(), job.optim.grad_clip or float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
    check_finite(acc, run, micro, losses, grad_norm)
    window["grad_norm"] = grad_norm.detach()
    m.optimizer.step()
    m.scheduler.step()
    m.optimizer.zero_grad(set_to_none=True)


def check_finite(acc, run, micro: list[Batch], losses: list[torch.Tensor], grad_norm: torch.Tensor) -> None:
    """Stop, before the update, if any process's loss or the gradient norm is not finite: one all_reduce and
    one read-back a step. losses: each micro-batch's loss sum [] (device)."""
    losses = torch.stack(losses)
    flags = torch.stack([(~torch.isfinite(losses)).any(), ~torch.isfinite(grad_norm)]).double()
    bad_loss, bad_norm = (acc.reduce(flags, reduction="sum") if acc.num_processes > 1 else flags).tolist()
    if bad_loss:
        finite = torch.isfinite(losses).tolist()
        if all(finite):
            raise TrainingError(_stopped(run, "non-finite loss on another process", micro[0], here=False))
        i = finite.index(False)
        raise TrainingError(_stopped(run, f"non-finite loss ({losses[i].item()})", micro[i]))
    if bad_norm:
        raise TrainingError(_stopped(run, f"non-finite gradient norm ({grad_norm.item()})", micro[-1]))


def _stopped(run, what: str, batch: Batch, here: bool = True) -> str:
    last = run.list_checkpoints()
    kept = f"the last good checkpoint {last[-1][1]} is untouched" if last else "no checkpoint was written yet"
    where = (f"epoch {batch.epoch}, micro-batch {batch.micro}, sequences {batch.ids}" if here else
             f"epoch {batch.epoch}; that process's error names its micro-batch and sequences")
    return (f"{what} at step {batch.step + 1} ({where}); stopping, {kept}. Lower optim.lr, check those sequences' "
            f"features, or resume from the last checkpoint with train.resume=latest")


def window_totals(acc, window: dict) -> dict:
    """The window's sums as host numbers, for a log line: loss_sum, tokens, anchors (summed over processes),
    weight (already global), grad_norm (the last step's) and counts (slot counts summed over processes, CPU
    tensors for metrics.finalize). One all_reduce and one device-to-host copy."""
    counts = window["counts"]
    host = torch.tensor([window["tokens"], window["anchors"]], dtype=torch.float64)
    parts = [window["loss_sum"].reshape(1), host.to(acc.device)] + [v.reshape(-1) for v in counts.values()]
    summed = torch.cat(parts)
    if acc.num_processes > 1:
        summed = acc.reduce(summed, reduction="sum")
    values = torch.cat([summed, window["weight"].reshape(1), window["grad_norm"].double().reshape(1)]).cpu()
    loss_sum, tokens, anchors = values[:3].tolist()
    sizes = [v.numel() for v in counts.values()]
    split = values[3:3 + sum(sizes)].split(sizes)
    return {"loss_sum": loss_sum, "tokens": tokens, "anchors": anchors, "weight": float(values[-2]),
            "grad_norm": float(values[-1]),
            "counts": {k: part.reshape(v.shape) for (k, v), part in zip(counts.items(), split)}}
