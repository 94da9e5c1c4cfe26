"""What a drafter buys at a concurrency: the serving cost model (`python -m dflash.plan ... concurrency=16`, and
bench/serving.py, which checks it against vLLM).

A request of n output tokens at concurrency C takes, without speculation, a first token (prefill) and n - 1 decode
steps: R_plain = ttft + (n - 1) * tpot(C). With a drafter of k drafts per step (the chain: block size - 1;
DDTree: the budget), each step verifies C x (k + 1) tokens with the target, drafts the next block with the drafter,
and keeps `tau` tokens on average (the mean acceptance length, the bonus token included):

    decode(C)   = overhead(C) + target(C x (k + 1) tokens) + drafter(C x block query tokens)
    step(C)     = decode(C) + tau x served(C) + admission(C) x C x tau / (n - 1)
    R_spec      = ttft + drafter(C) + (n - 1) / tau x step(C)
    speedup(C)  = R_plain / R_spec        (C requests in flight either way: throughput in the same ratio)

overhead(C) is what an engine step costs besides the target's forward (scheduling, sampling, the server):
tpot(C) - target(C x 1 token). A served step also admits the requests that arrive while it runs (their prefill,
the drafter's pass over their prompt, the engine's bookkeeping of them): C / (n - 1) a step without the drafter,
tau times as many with it, since a request then ends in (n - 1) / tau steps; admission(C) is what each costs.
served(C) is what serving costs per output token beyond the engine's clean step, where that step was timed:
tpot(C) - clean decode step(C) of the target alone; a speculative step hands tau tokens a request to the server,
so it pays served(C) tau times. (vLLM's CPU sweep of 2026-12-05: the drafter's served step was 9.9 ms at C = 1
against 5.6 ms timed clean and 1.3 ms of served(1) a token: 5.6 + 3.37 x 1.3 = 10.0; a per-step term gives 6.9.)

Where there is an engine to time, the micro-benchmark (bench/engines/vllm_steps.py) times in vLLM, with and
without the drafter, a decode step with C requests and none arriving, which then stands for decode(C) (on vLLM's
CPU build the speculative bookkeeping, rejection sampling and the drafter's inputs per request, costs more than
both forwards of a tiny model: overhead + forwards would miss it), and admission(C), a step that admits one more
request against one that admits none; its forward passes are recorded beside them. Before any
GPU is rented the forwards come from a roofline of the GPU: a forward reads the weights once and each request's
KV cache, and does 2 FLOPs per parameter per token; it takes the longer of the two at the GPU's achievable
bandwidth and FLOP rate, plus a fixed launch cost; the speculative bookkeeping counts as the engine's overhead (a
GPU engine runs it as kernels) and admissions are not modelled (no clean step). `tau` is measured
(teacher-forced walk, or live evaluation) and says where it came from; the model never invents one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash.config.plan import PlanConfig
from dflash.config.run import SERVING_GPUS
from dflash.errors import ConfigError


@dataclass
class Forwards:
    """Seconds of one forward pass at each concurrency C: the target over C x 1 tokens (`target_decode`), over the
    C x (k + 1) tokens of a verify step (`target_verify`), and the drafter over C x block query tokens (`drafter`)."""

    target_decode: dict[int, float]
    target_verify: dict[int, float]
    drafter: dict[int, float]
    spec_step: dict[int, float] = field(default_factory=dict)
    """A whole speculative engine step where one was timed (it then replaces overhead + forwards)."""
    admission: dict[int, float] = field(default_factory=dict)
    """Seconds a speculative step spends on each request it admits (the drafter's pass over the prompt too)."""
    clean_decode: dict[int, float] = field(default_factory=dict)
    """The target alone's decode step, timed as spec_step is (C requests, none arriving): with the baseline's tpot
    it gives what serving adds per output token (`served`)."""
    where: str = "measured"


@dataclass
class Baseline:
    """The target served alone at concurrency C: seconds to the first token and per output token after it."""

    ttft: dict[int, float]
    tpot: dict[int, float]


def decode_step(c: int, base: Baseline, fw: Forwards) -> float:
    """Seconds of a speculative decode step at concurrency c with no arrivals: as timed, or the plain step's
    overhead plus the verify and draft forwards."""
    if c in fw.spec_step:
        return fw.spec_step[c]
    return max(0.0, base.tpot[c] - fw.target_decode[c]) + fw.target_verify[c] + fw.drafter[c]


def served(c: int, base: Baseline, fw: Forwards) -> float:
    """Seconds serving adds per output token of a request at concurrency c beyond the clean engine step: the
    target alone's tpot(c) less its timed clean decode step; 0 where none was timed (the roofline's engine overhead
    is per step, in decode_step)."""
    return max(0.0, base.tpot[c] - fw.clean_decode[c]) if c in fw.clean_decode else 0.0


def spec_step(c: int, base: Baseline, fw: Forwards, tau: float, tokens: float) -> float:
    """Seconds of one served speculative step at concurrency c: its decode step, the server's work on the tau tokens
    a request it hands over, and the admissions of the requests arriving meanwhile, tau times as many a step as
    without the drafter (a request ends in (tokens - 1) / tau steps)."""
    arrivals = fw.admission.get(c, 0.0) * c * tau / max(tokens - 1, 1)
    return decode_step(c, base, fw) + tau * served(c, base, fw) + arrivals


def plain_request(c: int, tokens: float, base: Baseline) -> float:
    """R_plain: seconds of a request of `tokens` output tokens served by the target alone at concurrency c."""
    return base.ttft[c] + (tokens - 1) * base.tpot[c]


def spec_request(c: int, tau: float, tokens: float, base: Baseline, fw: Forwards) -> float:
    """R_spec: seconds of a request of `tokens` output tokens with the drafter at concurrency c."""
    return base.ttft[c] + fw.drafter[c] + (tokens - 1) / tau * spec_step(c, base, fw, tau, tokens)


def speedup(c: int, tau: float, tokens: float, base: Baseline, fw: Forwards) -> float:
    """Predicted throughput with the drafter over without, at concurrency c, for requests of `tokens` output tokens
    on average and a mean acceptance length `tau` (tokens per verify step)."""
    if tau < 1:
        raise ValueError(f"tau is the mean acceptance length, at least 1 (the target's own token); got {tau}")
    return plain_request(c, tokens, base) / spec_request(c, tau, tokens, base, fw)


def crossing(ratios: dict[int, float]) -> int | None:
    """The lowest concurrency at which the ratio is below 1 (speculation stops paying), None if it never is."""
    return next((c for c in sorted(ratios) if ratios[c] < 1.0), None)


# ---- the roofline, for a GPU without a measurement ----

@dataclass
class GPU:
    """A GPU as the roofline sees it: dense bf16 peak, memory bandwidth, and what a forward achieves of them."""

    name: str
    tflops: float  # dense bf16 peak
    tbps: float  # HBM bandwidth, TB/s
    flops_efficiency: float = 0.6  # of the peak a large inference GEMM reaches
    bandwidth_efficiency: float = 0.8  # of the bandwidth a weight/KV read reaches
    launch_s: float = 0.2e-3  # per forward with CUDA graphs: kernels' launches and the smallest layers' floor


GPUS = {"h200": GPU("H200 SXM", 989.0, 4.8), "h100": GPU("H100 SXM", 989.0, 3.35),
        "a100": GPU("A100 SXM 80GB", 312.0, 2.0)}
"""Published dense bf16 peaks and bandwidths (NVIDIA's data sheets); the efficiencies are assumptions. Keyed by
dflash.config's SERVING_GPUS, which eval.serving.gpu is checked against when the config is built."""
if tuple(GPUS) != SERVING_GPUS:
    raise ImportError(f"dflash.plan.serving.GPUS names {tuple(GPUS)} but dflash.config SERVING_GPUS {SERVING_GPUS}: "
                      f"add the GPU to both")


@dataclass
class Model:
    """What a forward costs per token and per request: parameters a token runs through (2 FLOPs each), the bytes
    of weights read once per forward, and the KV-cache bytes of one context token (read by every query of the
    request: attention's reads)."""

    flop_params: float
    weight_bytes: float
    kv_bytes_per_token: float


def forward_seconds(m: Model, gpu: GPU, requests: int, tokens_each: int, context: int) -> float:
    """Roofline seconds of one forward over `requests` x `tokens_each` new tokens, each request with `context`
    tokens in its KV cache."""
    flops = 2.0 * m.flop_params * requests * tokens_each
    read = m.weight_bytes + requests * context * m.kv_bytes_per_token
    return max(flops / (gpu.tflops * 1e12 * gpu.flops_efficiency),
               read / (gpu.tbps * 1e12 * gpu.bandwidth_efficiency)) + gpu.launch_s


def roofline(target: Model, drafter: Model, block: int, verify: int, gpu: GPU, concurrency: list[int],
             context: int, overhead_s: float = 0.0) -> tuple[Baseline, Forwards]:
    """Baseline and forward costs at each concurrency from the roofline: the target alone decodes one token per
    request per step; with the drafter it verifies `verify` tokens per request (the chain: the block; DDTree: the
    budget + 1) and the drafter reads `block` query tokens per request; `overhead_s` is the engine's time per step
    besides the forward (0: a GPU-bound engine)."""
    decode = {c: forward_seconds(target, gpu, c, 1, context) for c in concurrency}
    base = Baseline(ttft={c: forward_seconds(target, gpu, c, context, 0) for c in concurrency},
                    tpot={c: decode[c] + overhead_s for c in concurrency})
    fw = Forwards(target_decode=decode,
                  target_verify={c: forward_seconds(target, gpu, c, verify, context) for c in concurrency},
                  drafter={c: forward_seconds(drafter, gpu, c, block, context) for c in concurrency},
                  where=f"roofline of the {gpu.name} ({gpu.tflops:g} TFLOP/s x {gpu.flops_efficiency}, "
                        f"{gpu.tbps:g} TB/s x {gpu.bandwidth_efficiency}, {gpu.launch_s * 1e3:g} ms per forward)")
    return base, fw


# ---- the plan's serving section: `python -m dflash.plan experiment=... concurrency=...` ----

def target_model(text, shape, context: int) -> Model:
    """The target's roofline Model from its text config and the plan's Shape (bf16 weights and KV cache): every
    parameter but the input embedding is read (all experts of a MoE: at a batch, most are routed to), a token runs
    through its active ones; the KV cache is `kv_bytes_per_token`'s."""
    embed = shape.vocab * shape.hidden
    active = shape.target_active_params or shape.target_params
    weights = shape.target_params - (0 if shape.tied else embed)
    return Model(flop_params=active - (0 if shape.tied else embed), weight_bytes=2.0 * weights,
                 kv_bytes_per_token=kv_bytes_per_token(text, context))


def kv_bytes_per_token(text, context: int) -> float:
    """bf16 keys and values of one context token, summed over the layers that keep them: full-attention layers
    whole, sliding-window ones up to the window (a share of the `context` tokens), each with its own KV heads and
    head width (Gemma 4's differ per layer: its config's per_layer_config); linear-attention layers keep a fixed
    state and layers that reuse another's KV (kv_sharing_modes "reuse") none."""
    types = list(getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers)
    window = getattr(text, "sliding_window", None) or context
    per_layer = getattr(text, "per_layer_config", None)
    sharing = getattr(text, "kv_sharing_modes", None) or [None] * len(types)
    total = 0.0
    for i, kind in enumerate(types):
        reach = 1.0 if kind == "full_attention" else min(1.0, window / max(context, 1)) if "sliding" in kind else 0.0
        if not reach or sharing[i] == "reuse":
            continue
        layer = per_layer[i] if per_layer else text
        kv_heads = getattr(layer, "num_key_value_heads", None) or text.num_attention_heads
        head_dim = getattr(layer, "head_dim", None) or text.hidden_size // text.num_attention_heads
        total += reach * 2 * 2 * kv_heads * head_dim
    return total


def drafter_model(shape, layers: int) -> Model:
    """A drafter of `layers` layers of the Shape's kind: its layers, fc and norms, and the target's lm_head for its
    block's logits (bf16); its KV cache holds each context token's keys and values in every layer."""
    own = layers * shape.layer_params + shape.root_params
    head = shape.vocab * shape.hidden
    return Model(flop_params=own + head, weight_bytes=2.0 * (own + head),
                 kv_bytes_per_token=layers * 2 * 2 * shape.kv_heads * shape.head_dim)


def needed_tau(c: int, goal: float, tokens: float, block: int, base: Baseline, fw: Forwards) -> float | None:
    """The mean acceptance length a drafter needs for throughput `goal` x the target alone at concurrency c;
    None where even tau = block (every draft accepted) does not reach it."""
    # R_spec is fixed + per_tau / tau (spec_step is linear in tau): both read off two evaluations of it, so this
    # inverts `speedup` by construction rather than by a second copy of its algebra
    one, two = spec_request(c, 1.0, tokens, base, fw), spec_request(c, 2.0, tokens, base, fw)
    per_tau = 2 * (one - two)
    room = plain_request(c, tokens, base) / goal - (one - per_tau)  # R_plain / goal - fixed
    tau = per_tau / room if room > 0 else float("inf")
    return max(1.0, tau) if tau <= block else None


def predict(shape, text, tau: float | None, gpu: str, concurrency: list[int], context: int, tokens: float,
            overhead_s: float = 0.0) -> dict:
    """The serving model for a drafter of the plan's Shape on a GPU's roofline (the plan's configured drafter, live
    evaluation's summary): {gpu, forwards_from, context, output_tokens, tau, plain_step_ms and spec_step_ms per C,
    and with a measured tau speedup: {C: ratio}}; `overhead_s` the engine's time a step. tau is in [1, block size]:
    a step keeps at most the block (plan_serving refuses any other tau= in one line)."""
    if tau is not None and tau > shape.block_size:
        raise ValueError(f"tau {tau} is more than the block size {shape.block_size}: no step keeps that many tokens")
    device = GPUS[gpu.lower()]
    base, fw = roofline(target_model(text, shape, context), drafter_model(shape, shape.layers), shape.block_size,
                        shape.block_size, device, concurrency, context, overhead_s)
    out = {"gpu": device.name, "forwards_from": fw.where, "context": context, "output_tokens": tokens,
           "tau": tau,
           "plain_step_ms": {c: base.tpot[c] * 1e3 for c in concurrency},
           "spec_step_ms": {c: decode_step(c, base, fw) * 1e3 for c in concurrency}}
    if tau is not None:
        out["speedup"] = {c: speedup(c, out["tau"], tokens, base, fw) for c in concurrency}
    return out


def plan_serving(shape, text, opts: PlanConfig, tau: float | None = None, where: str | None = None) -> dict:
    """The serving section of the plan: the configured drafter's speedup at each concurrency on opts' GPU (the
    roofline), and for other block sizes and layer counts the tau each needs to match it. `tau`: the drafter's
    acceptance length as read from opts.tau (`where`: what it was read from), None where none is given."""
    gpu = GPUS.get(str(opts.gpu).lower())
    if gpu is None:
        raise ConfigError(f"gpu={opts.gpu}: one of {', '.join(GPUS)}")
    conc = [int(c) for c in opts.concurrency]
    context, tokens, overhead = int(opts.context), float(opts.output_tokens), opts.overhead_ms / 1e3
    target = target_model(text, shape, context)
    if tau is not None and not 1 <= tau <= shape.block_size:  # the model would price another tau than it prints
        raise ConfigError(f"tau={opts.tau}: {tau:g} is outside [1, {shape.block_size}]: a step keeps the target's "
                          f"own token and at most the block (drafter.block_size={shape.block_size}); give tau in "
                          f"[1, {shape.block_size}]")

    def costs(layers: int, block: int) -> tuple[Baseline, Forwards]:
        return roofline(target, drafter_model(shape, layers), block, block, gpu, conc, context, overhead)

    out = {**predict(shape, text, tau, str(opts.gpu), conc, context, tokens, overhead), "concurrency": conc,
           "overhead_ms": opts.overhead_ms, "block_size": shape.block_size, "layers": shape.layers, "tau": tau,
           "tau_where": where}
    goal = out["speedup"] if tau is not None else {c: 1.0 for c in conc}
    shapes = []
    for block in sorted({4, 8, 16, shape.block_size}):
        for layers in sorted({1, 2, 3, 5, 8, shape.layers}):
            b, f = costs(layers, block)
            shapes.append({"block_size": block, "layers": layers, "budget": None,
                           "needed_tau": {c: needed_tau(c, goal[c], tokens, block, b, f) for c in conc},
                           "spec_step_ms": {c: decode_step(c, b, f) * 1e3 for c in conc}})
    for budget in (16, 32, 64):  # DDTree on the configured drafter: the target verifies budget + 1 tokens
        b, f = roofline(target, drafter_model(shape, shape.layers), shape.block_size, budget + 1, gpu, conc, context,
                        overhead)
        shapes.append({"block_size": shape.block_size, "layers": shape.layers, "budget": budget,
                       "needed_tau": {c: needed_tau(c, goal[c], tokens, shape.block_size, b, f) for c in conc},
                       "spec_step_ms": {c: decode_step(c, b, f) * 1e3 for c in conc}})
    out["shapes"] = shapes
    out["shapes_goal"] = "the configured drafter's speedup" if tau is not None else "break-even with the target alone"
    return out


def render_serving(plan: dict) -> str:
    conc = plan["concurrency"]
    def row(label: str, values) -> str:
        return f"  {label:<34}" + "".join(values)

    lines = [f"Serving on one {plan['gpu']} (a model, not a measurement: {plan['forwards_from']}; engine overhead "
             f"{plan['overhead_ms']:g} ms a step), {plan['context']} tokens of context and {plan['output_tokens']:g} "
             f"output tokens a request:",
             row("concurrency", (f"{c:>9}" for c in conc)),
             row("target alone, ms a step", (f"{plan['plain_step_ms'][c]:>9.2f}" for c in conc)),
             row(f"with the drafter ({plan['layers']} layers, block {plan['block_size']})",
                 (f"{plan['spec_step_ms'][c]:>9.2f}" for c in conc))]
    if plan["tau"] is not None:
        lines.append(row(f"speedup at tau {plan['tau']:.2f}", (f"{plan['speedup'][c]:>8.2f}x" for c in conc)))
        lines.append(f"  (tau: {plan['tau_where']})")
    else:
        lines.append("  no tau given (tau=<number>, tau=<summary.json> or tau=dflash_paper:gsm8k): no speedup")
    lines.append(f"Other shapes: the tau each needs for {plan['shapes_goal']} (-: not reachable: more than it verifies)")
    lines.append(row("block, layers (DDTree budget)", (f"{c:>9}" for c in conc)))
    for s in plan["shapes"]:
        label = f"{s['block_size']}, {s['layers']}" + (f" (DDTree {s['budget']})" if s["budget"] else "")
        mark = " <- configured" if (s["block_size"], s["layers"], s["budget"]) == (
            plan["block_size"], plan["layers"], None) else ""
        lines.append(row(label, (f"{t:>9.2f}" if t is not None else f"{'-':>9}" for t in s["needed_tau"].values()))
                     + mark)
    return "\n".join(lines)
