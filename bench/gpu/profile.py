"""Where a training step's time goes, by op class: one step under torch.profiler, its time summed per class.

    profile = profile_step(step, device)   # {"activity", "step_ms", "total_ms", "classes", "top", "seconds"}

On CUDA the profiler records the device's kernels (CUPTI) and the CPU ops that launched them; each kernel's
time counts once, in the class of its name or of the op that launched it. On CPU each op's self time
counts (its time less its children's), so the classes sum to the time the ops covered. bench/gpu/steps.py's
`preset_step` records one such profile (the `profile` field of qwen3_6_step and qwen3_6_dflash2_step).
"""

from __future__ import annotations

import time

import torch

CLASSES = ("matmul", "attention", "elementwise", "loss", "optimizer", "communication", "other")

# class -> substrings of a lowercased kernel or op name; the first class with a match wins, so the order
# settles overlaps: "reduce_scatter" is communication before "reduce" is elementwise, "aten::addmm" matmul
# before "add" is elementwise, a cutlass kernel of flash attention attention before "cutlass" is matmul
RULES = (
    ("communication", ("nccl", "allreduce", "all_reduce", "allgather", "all_gather", "reduce_scatter",
                       "alltoall", "all_to_all", "c10d::", "broadcast_coalesced")),
    ("optimizer", ("adam", "foreach", "multi_tensor_apply", "optimizer.", "clip_grad")),
    ("loss", ("cross_entropy", "crossentropy", "log_softmax", "logsoftmax", "nll")),
    ("attention", ("flex_attention", "scaled_dot_product", "sdpa", "flash", "fmha", "attention",
                   "triton_tem_fused")),  # inductor's templates: here only flex attention is compiled
    ("matmul", ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
                "gemm", "cutlass", "cublas", "nvjet", "xmma", "sm90", "sm80", "s16816")),
    ("elementwise", ("elementwise", "pointwise", "copy", "memcpy", "memset", "mul", "add", "sub", "div", "silu",
                     "sigmoid", "rms", "norm", "rsqrt", "pow", "exp", "mean", "sum", "reduce", "fill", "zero",
                     "cat", "where", "triton_poi", "triton_red", "triton_per", "cast", "neg", "clamp")),
)
# the classes an enclosing op gives every kernel and op under it (an sdpa's softmax is attention, AdamW's
# multiplications the optimizer's); matmul and elementwise come from the name itself
ENCLOSING = ("communication", "optimizer", "loss", "attention")


def classify(name: str, classes=CLASSES) -> str:
    """The class of one kernel or op name (one of CLASSES; "other" when no rule matches)."""
    low = name.lower()
    return next((c for c, keys in RULES if c in classes and any(k in low for k in keys)), "other")


def classify_in(name: str, ops: list[str]) -> str:
    """The class of a kernel or op `name` launched under `ops` (the op that launched it first, then the ops
    around it, outwards): the outermost op of an ENCLOSING class gives its class, else the name's own,
    else the nearest op's."""
    for op in reversed(ops):
        cls = classify(op, ENCLOSING)
        if cls != "other":
            return cls
    for candidate in (name, *ops):
        cls = classify(candidate)
        if cls != "other":
            return cls
    return "other"


def _ops(event) -> list[str]:
    """The names of `event` and the CPU ops around it, innermost first."""
    names = []
    while event is not None:
        names.append(event.name)
        event = event.cpu_parent
    return names


def leaves(events, device_type: str) -> list[tuple[str, float, str]]:
    """(name, microseconds, class) of what ran: on "cuda" every kernel, memcpy and memset on the device, in
    the class of its name or of the op that launched it; on "cpu" every op's self time."""
    from torch.autograd import DeviceType

    cpu = [e for e in events if e.device_type == DeviceType.CPU and not e.is_async]
    if device_type == "cpu":
        return [(e.name, e.self_cpu_time_total, classify_in(e.name, _ops(e.cpu_parent))) for e in cpu]
    launchers = {e.id: e for e in cpu if not getattr(e, "linked_correlation_id", 0)}
    out = []
    for e in events:
        if e.device_type != DeviceType.CUDA or e.is_user_annotation:  # a record_function's range, not a kernel
            continue
        op = launchers.get(getattr(e, "linked_correlation_id", 0))
        out.append((e.name, e.time_range.elapsed_us(), classify_in(e.name, _ops(op))))
    return out


def summarize(items: list[tuple[str, float, str]], step_ms: float, top: int = 10) -> dict:
    """Per class its ms and share of the summed time, and the `top` names by time (ms, calls, class)."""
    total = sum(us for _, us, _ in items)
    per_class = {c: 0.0 for c in CLASSES}
    by_name: dict[str, list] = {}
    for name, us, cls in items:
        per_class[cls] += us
        entry = by_name.setdefault(name[:160], [0.0, 0, cls])
        entry[0] += us
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    return {"step_ms": round(step_ms, 3), "total_ms": round(total / 1e3, 3),
            "classes": {c: {"ms": round(us / 1e3, 3), "share": round(us / total, 4) if total else 0.0}
                        for c, us in per_class.items()},
            "top": [{"name": n, "ms": round(us / 1e3, 3), "calls": k, "class": c} for n, (us, k, c) in ranked]}


def profile_step(step, device, top: int = 10) -> dict:
    """One call of `step` (warmed up by the caller: a compile would be profiled) under torch.profiler, on
    CUDA its kernels (with the CPU ops that launched them), on CPU its ops: `summarize`d, with "activity"
    (what was summed: "cuda" kernel time or "cpu" op self time), "step_ms" (the step's wall time under the
    profiler, which slows the host side) and "seconds" (what the profile cost, its processing included)."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        step_ms = (time.perf_counter() - t0) * 1e3
    items = leaves(prof.events(), "cuda" if cuda else "cpu")
    out = {"activity": "cuda" if cuda else "cpu", **summarize(items, step_ms, top)}
    if not items or not out["total_ms"]:
        out["error"] = "the profiler recorded no " + ("kernel (is CUPTI available?)" if cuda else "op")
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out
