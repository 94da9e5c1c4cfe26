"""One optimizer step of the training loop (`train_step`), and the sums it leaves for the log line.

What a step costs the host, on CUDA, outside the log and checkpoint steps:
- gradients are reduced once, in the last micro-batch's backward; the others run forward and backward inside
  accelerate's `no_sync` (DDP reads its flag in the forward, FSDP2 in the backward: both run inside it);
- one collective before the forwards, the step's global weight sum (exact loss normalisation), queued on the
  device from a host number, and no read-back: the scale it gives stays a device tensor;
  (loss.normalize=anchor: the valid anchors instead, also host numbers; loss=dpace with loss.normalize=weights
  has its normaliser only after the forwards: the backwards are scaled by 1/anchors and the gradients rescaled
  by anchors/weights afterwards, one more all_reduce and read-back, `rescale_gradients`);
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
from dflash.drafter.loss import block_terms, label_logits
from dflash.drafter.selector_loss import SelectorOptions, schedule_weight
from dflash.errors import ConfigError, TrainingError
from dflash.target.features import target_forward
from dflash.train.accel import is_fsdp
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
    return target_forward(target, ids, drafter.target_layer_ids).features.float()  # right padding: no mask


def features_and_logits(acc, target, drafter, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Online, for the soft-label losses (loss=kl, tv, nla, expected_tau): (features float32
    [b, L, n_layers*H], logits [b, L, vocab]) from one target forward."""
    ids = to_device(batch.input_ids, acc.device)
    out = target_forward(target, ids, drafter.target_layer_ids, logits_to_keep=0)  # right padding: no mask
    return out.features.float(), out.logits


def soft_targets(batch: Batch, logits: torch.Tensor | None, blocks, rows: torch.Tensor, dev,
                 objective: str = "kl") -> dict:
    """block_loss's soft-label argument at the labelled rows: the target's full logits (online), or the
    top-k distributions the cache stores (offline, features.topk_logits). objective: loss.objective, for the
    error."""
    if logits is not None:
        return {"target_logits": label_logits(logits, blocks.anchors, rows, blocks.block_size)}
    if batch.topk is None:
        raise ConfigError(f"loss={objective} needs the target's next-token distributions, and this micro-batch "
                          "has none: the feature cache was extracted without features.topk_logits. Extract into a "
                          "new features.dir with features.topk_logits=64 (say), or train with train.mode=online")
    at = lambda t: label_logits(to_device(t, dev), blocks.anchors, rows, blocks.block_size)  # noqa: E731
    return {"target_topk": (at(batch.topk.logprobs), at(batch.topk.ids), at(batch.topk.rest[..., None])[:, 0])}


def target_argmax(batch: Batch, logits: torch.Tensor | None, blocks, rows: torch.Tensor, dev) -> torch.Tensor:
    """[N] the target's argmax at the labelled rows, the selector's gold tokens with loss.selector.labels=target:
    from its logits (online), or the first of the cache's stored top-k ids (offline; sorted, the argmax first)."""
    if logits is not None:
        return label_logits(logits.argmax(-1), blocks.anchors, rows, blocks.block_size)
    if batch.topk is None:
        raise ConfigError("loss.selector.labels=target needs the target's argmax, and this micro-batch has none: "
                          "train with train.mode=online, or extract into a new features.dir with "
                          "features.topk_logits=1 (or more)")
    return label_logits(to_device(batch.topk.ids[..., 0], dev), blocks.anchors, rows, blocks.block_size)


def valid_anchors(batch: Batch) -> int:
    """Blocks of the micro-batch with at least one labelled slot (host numbers: blocks are still CPU tensors)."""
    return int(batch.blocks.label_mask.any(-1).sum())


def rescale_gradients(acc, model, anchors: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """loss.normalize=weights with D-PACE weights, which exist only after the forwards: the backwards were
    scaled by 1 / (the step's valid anchors); multiply the gradients by anchors / (the step's D-PACE weight
    sum, all processes), which makes them those of loss_sum / weight_sum exactly. One all_reduce and one
    read-back. Returns the global weight sum (float64, device)."""
    total = torch.stack(weights).double().sum()
    total = acc.reduce(total, reduction="sum") if acc.num_processes > 1 else total
    factor = float(anchors / total.clamp_min(1e-12))
    for p in model.parameters():
        if p.grad is not None:
            p.grad.mul_(factor)
    return total


def global_weight(acc, micro: list[Batch], share=lambda b: b.weight_sum) -> torch.Tensor:
    """The step's loss normaliser: the slot weights of all its micro-batches on all processes, a float64 scalar
    on the device. Each batch's share is a host number; their sum is copied without waiting and all_reduced on
    the device, queued before the forwards, and only the first backward's scaling waits for it. (A reduce on
    the host would need a gloo group beside NCCL, and a read-back, `.item()`, would wait for the device.)
    share(batch): a batch's host-side share (the slot weights, or `valid_anchors` for loss.normalize=anchor)."""
    local = torch.tensor(sum(share(b) for b in micro), dtype=torch.float64)
    local = to_device(local.pin_memory() if acc.device.type == "cuda" else local, acc.device)
    return acc.reduce(local, reduction="sum") if acc.num_processes > 1 else local


def train_step(job, acc, m, target, micro: list[Batch], state, gamma: float, backend: str, run) -> None:
    """One optimizer step over `micro` (grad_accum micro-batches of loop.Model `m`); its sums go into
    state.window, as device tensors. Host syncs and collectives: see this module's docstring."""
    dev = acc.device
    cfg, sc = job.loss, job.loss.selector
    dpace_by_weights = cfg.weighting == "dpace" and cfg.normalizer == "weights"  # normaliser known after forwards
    by_anchor = cfg.normalizer == "anchor" or dpace_by_weights
    total_w = global_weight(acc, micro, valid_anchors if by_anchor else (lambda b: b.weight_sum))
    selector = m.drafter.candidate_selector if sc.weight > 0 else None
    sel = {}
    if selector is not None:  # DFlash 2: the selector's CE, the mean over its slot weights, at the scheduled weight
        sel = {"selector": selector,
               "selector_options": SelectorOptions(sc.gradient, sc.gold, sc.dropout, sc.weights, sc.shrink)}
        weight_now = schedule_weight(state.step, state.total_steps, sc.weight, sc.warmup_ratio, sc.ramp_ratio)
        # decay weights, every row counted: the normaliser is the step's, known on the host before the forwards
        # (exact under accumulation and DDP; one more collective only when the per-slot loss has another one);
        # D-PACE weights or gold=strict: known after each forward only, so each micro-batch's own mean, averaged
        whole_step = sc.gold == "inject" and (sc.weights == "decay" or cfg.weighting == "decay")
        if whole_step:
            decay_w = total_w if not by_anchor and cfg.weighting == "decay" else global_weight(acc, micro)
            selector_scale = weight_now * acc.num_processes / decay_w.clamp_min(1e-12)
    soft, dyn_weights = cfg.soft_labels, []
    target_labels = selector is not None and sc.labels == "target"
    options = {} if cfg.objective == "decay_ce" else {"weighting": cfg.weighting, "alpha": cfg.alpha}
    if soft:  # expected_tau's weight_sum is its blocks with a label: loss.normalize=anchor's normaliser
        options.update(objective=cfg.objective, temperature=cfg.temperature)
    scale = acc.num_processes / total_w.clamp_min(1e-12)  # DDP averages gradients over processes
    # the fused selector CE hands its parameters' gradients to autograd in backward, from tensors it saw in the
    # forward: under FSDP2 those are unsharded copies resharded after the forward, so FSDP keeps the recompute
    fused_ce = cfg.fused_ce and not (selector is not None and is_fsdp(acc))
    window, n_layers = state.window, len(m.drafter.target_layer_ids)
    losses = []  # per micro-batch, on the device: which one was non-finite is found after the check
    for i, batch in enumerate(micro):
        blocks = map_tensors(batch.blocks, lambda t: to_device(t, dev))
        logits = None
        if (soft or target_labels) and batch.features is None:  # online: the target's logits, from the same forward
            clean, logits = features_and_logits(acc, target, m.drafter, batch)
        else:
            clean = batch_features(acc, target, m.drafter, batch)
        noised = add_noise(clean, job.noise, n_layers, job.train.seed, batch.epoch, batch.index)
        # the backward inside no_sync too: FSDP2 reads the flag there (DDP in the forward)
        with acc.no_sync(m.model) if i < len(micro) - 1 else nullcontext():
            with acc.autocast():
                hidden = draft_packed(m.drafter, target.embed_tokens, noised, blocks, backend, model=m.model,
                                      num_blocks=job.train.num_anchors)
                rows = to_device(batch.label_rows, dev)
                if soft:
                    options.update(soft_targets(batch, logits, blocks, rows, dev, cfg.objective))
                if target_labels:
                    sel["selector_labels"] = target_argmax(batch, logits, blocks, rows, dev)
                terms = block_terms(hidden, target.lm_head.weight, blocks.labels, blocks.label_mask, gamma,
                                    job.loss.chunk_logits, rows=rows, scales=m.drafter.scales,
                                    fused_ce=fused_ce, **sel, **options)
                loss_sum, selector_sum = terms.loss_sum, terms.selector_sum if selector is not None else 0.0
                if selector is not None and not whole_step:
                    selector_mean = terms.selector_weight_sum.clamp_min(1e-12)
                    selector_scale = weight_now / (len(micro) * selector_mean)
            acc.backward(loss_sum * scale + (selector_sum * selector_scale if selector is not None else 0.0))
        if dpace_by_weights:
            dyn_weights.append(terms.weight_sum.detach())
        losses.append((loss_sum + selector_sum).detach())  # either part non-finite stops the step
        window["loss_sum"] = window.get("loss_sum", 0.0) + loss_sum.detach().double()
        counts = metrics.count(terms.predictions, blocks.labels, blocks.label_mask)
        if selector is not None:  # the selector's choices are what a DFlash 2 drafter drafts: train/tau is theirs
            part = terms.selector_sum.detach().double()
            if not whole_step:  # the micro-batch's mean, one count of `selector_weight` on each process
                part = part / selector_mean
                window["selector_weight"] = window.get("selector_weight", 0.0) + torch.full(
                    (), float(acc.num_processes), dtype=torch.float64, device=dev)
            window["selector_sum"] = window.get("selector_sum", 0.0) + part
            unary = {f"unary_{k}": v for k, v in counts.items()}
            oracle = {f"oracle_{k}": v for k, v in metrics.count(terms.oracle_predictions, blocks.labels,
                                                                 blocks.label_mask).items()}
            counts = {**metrics.count(terms.selector_predictions, blocks.labels, blocks.label_mask), **unary, **oracle}
        window["counts"] = metrics.add(window.get("counts"), counts)
        window["tokens"] = window.get("tokens", 0) + batch.num_tokens
        window["anchors"] = window.get("anchors", 0) + batch.num_blocks
    if dpace_by_weights:
        total_w = rescale_gradients(acc, m.model, total_w, dyn_weights)
    window["weight"] = window.get("weight", 0.0) + total_w  # global: all processes and micro-batches
    if selector is not None and whole_step:
        window["selector_weight"] = window.get("selector_weight", 0.0) + decay_w
    grad_norm = acc.clip_grad_norm_(m.model.parameters(), job.optim.grad_clip or float("inf"))
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm  # FSDP2: a DTensor
    check_finite(acc, run, micro, losses, grad_norm)
    window["grad_norm"] = grad_norm.detach()
    m.optimizer.step()
    if m.after_step is not None:
        m.after_step()
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
    zero = torch.zeros(1, dtype=torch.float64, device=acc.device)
    selector = window.get("selector_sum", zero).reshape(1)  # DFlash 2's selector CE (0 for DFlash)
    parts = [window["loss_sum"].reshape(1), host.to(acc.device), selector] + [v.reshape(-1) for v in counts.values()]
    summed = torch.cat(parts)
    if acc.num_processes > 1:
        summed = acc.reduce(summed, reduction="sum")
    values = torch.cat([summed, window["weight"].reshape(1), window.get("selector_weight", zero).reshape(1),
                        window["grad_norm"].double().reshape(1)]).cpu()
    loss_sum, tokens, anchors, selector_sum = values[:4].tolist()
    sizes = [v.numel() for v in counts.values()]
    split = values[4:4 + sum(sizes)].split(sizes)
    out = {"loss_sum": loss_sum, "tokens": tokens, "anchors": anchors, "weight": float(values[-3]),
           "grad_norm": float(values[-1]),
           "counts": {k: part.reshape(v.shape) for (k, v), part in zip(counts.items(), split)}}
    if "selector_sum" in window:
        out.update(selector_sum=selector_sum, selector_weight=float(values[-2]))
    return out
