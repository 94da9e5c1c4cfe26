"""The verdicts of bench/gpu/checks.py: PASS or FAIL, and the line's figures, from what a check measured (pure
functions of its results, so the tests judge fabricated ones on CPU)."""

from __future__ import annotations

RECIPE_LENGTH = 3072
PLAN_TOL = 0.15  # the plan's peak against the measured one (tests/plan/test_plan.py holds it to this on CPU)
BF16_TIE_MARGIN = 0.1  # the floor dflash.evaluate.live takes for a tie of bf16 logits (eval.decode.tie_margin
# null); live widens it to 4 units in the last place of the top logit where larger (tie_margin_at: 0.5 at a logit of 20)


def flex_verdict(out: dict, flex: bool = True, recipe: int = RECIPE_LENGTH) -> dict:
    """PASS or FAIL for bench.gpu.steps.flex_lengths' results, by dynamo's own counts: FAIL when a length of an
    already compiled padded shape compiled a graph (a recompile: each batch would pay it again), when a
    step after a length's first compiled anything, when the recompile limit was hit (flex then runs
    uncompiled), when a new shape compiled nothing under flex (it ran uncompiled), when the recipe's
    length was not measured, or when no measured length reused a shape (the reuse went untested)."""
    rec, why = out["lengths"], []
    if out["recompile_limit_hits"]:
        why.append(f"recompile limit hit: {out['recompile_limit_hits'][0]}")
    again = {L: r for L, r in rec.items() if r["timed_steps_compiled"]["graphs"]
             or (not r["new_shape"] and r["first_step_compiled"]["graphs"])}
    if again:
        why.append("recompiled a compiled shape: " + ", ".join(
            f"{L} ({r['first_step_compiled']['graphs'] * (not r['new_shape'])} graphs in its first step, "
            f"{r['timed_steps_compiled']['graphs']} in the steps after)" for L, r in again.items())
            + (f"; dynamo: {out['recompile_reasons'][-1]}" if out.get("recompile_reasons") else ""))
    new = {L: r for L, r in rec.items() if r["new_shape"]}
    if flex and any(r["first_step_compiled"]["graphs"] == 0 for r in new.values()):
        uncompiled = [L for L, r in new.items() if not r["first_step_compiled"]["graphs"]]
        why.append(f"no graph compiled for a new shape ({uncompiled}): flex ran uncompiled")
    if recipe not in rec:
        why.append(f"the recipe's length {recipe} was not measured")
    reused = [L for L, r in rec.items() if not r["new_shape"]]
    if rec and not reused:
        why.append("no measured length reused a compiled shape: graph reuse went untested")
    r = list(rec.values())
    best = max(r, key=lambda x: x["tflops"]) if r else {}
    mfus = [x["mfu"] for x in r if x["mfu"] is not None]
    peaks = [x["peak_memory_gib"] for x in r if x["peak_memory_gib"] is not None]
    c = out["compiles"]
    figures = (f"{len(rec)}/{len(rec) + len(out['skipped'])} lengths ({', '.join(map(str, rec))})"
               + (f", skipped for time {sorted(out['skipped'])}" if out["skipped"] else "")
               + f", {min((x['context_tokens_per_s'] for x in r), default=0):.0f}-"
                 f"{max((x['context_tokens_per_s'] for x in r), default=0):.0f} context tok/s, "
                 f"{best.get('tflops', 0)} TFLOP/s best, "
               + (f"mfu {min(mfus):.3f}-{max(mfus):.3f}" if mfus else "mfu n/a")
               + f", peak {max(peaks, default=0)} GiB; dynamo: {c['dynamo_graphs']} graphs, {c['dynamo_recompiles']} "
                 f"recompiles for {len(new)} new shapes, 0 expected for the {len(reused)} reused "
                 f"({', '.join(map(str, reused)) or 'none'}); dflash's flex count {c['flex_compile_count']}")
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why) + (": " if why else "") + figures, **out}


def preset_verdict(out: dict) -> dict:
    """PASS when the plan's peak is within PLAN_TOL of the measured one, and so are its peak of the forward and
    backward alone and that peak's rise over what the step starts with (the step's peak is the optimizer's, 20
    bytes a parameter and AdamW's foreach temporary: it would pass with activations off by 2.5x; the rise is what
    the activations and gradients add, so an activation term off either way shows in it), nothing compiled after
    the first step, the recompile limit was not hit and (under flex) the first step compiled."""
    why, ratio, act = [], out["plan_over_measured"], out["plan_activation_over_measured"]
    if abs(ratio - 1) > PLAN_TOL:
        why.append(f"the plan's peak {out['plan_peak_gib']} GiB ({out['plan_phase']}) is {ratio:.3f}x the measured "
                   f"{out['peak_memory_gib']} GiB (tolerance {PLAN_TOL:.0%}): correct the plan's terms")
    rise = out["plan_activation_rise_over_measured"]
    if abs(act - 1) > PLAN_TOL or abs(rise - 1) > PLAN_TOL:
        why.append(f"the plan's peak of the forward and backward {out['plan_activation_peak_gib']} GiB "
                   f"({out['plan_activation_phase']}) is {act:.3f}x the measured {out['activation_peak_gib']} GiB, "
                   f"its rise over the step's start {rise:.3f}x the measured {out['activation_rise_gib']} GiB "
                   f"(tolerance {PLAN_TOL:.0%}): correct the plan's activation terms")
    if out["timed_steps_compiled"]["graphs"]:
        why.append(f"{out['timed_steps_compiled']['graphs']} graphs compiled after the first step (a recompile of "
                   f"the same shape)" + (f": {out['recompile_reasons'][-1]}" if out["recompile_reasons"] else ""))
    if out["recompile_limit_hits"]:
        why.append(f"recompile limit hit: {out['recompile_limit_hits'][0]}")
    if out["backend"] == "flex" and not out["first_step_compiled"]["graphs"]:
        why.append("the first step compiled no graph: flex ran uncompiled")
    figures = (f"{out['shape']}: {out['context_tokens_per_s']:.0f} context tok/s ({out['block_tokens_per_s']:.0f} "
               f"block tok/s), {out['tflops']} TFLOP/s, "
               + (f"mfu {out['mfu']}" if out["mfu"] is not None else "mfu n/a")
               + f", first step {out['first_step_s']} s; dynamo: {out['first_step_compiled']['graphs']} graphs for "
                 f"{out['mask_kinds']} mask kinds, {out['timed_steps_compiled']['graphs']} after; peak "
                 f"{out['peak_memory_gib']} GiB, plan {out['plan_peak_gib']} GiB (x{ratio}, {out['plan_phase']}); "
                 f"forward and backward {out['activation_peak_gib']} GiB, plan {out['plan_activation_peak_gib']} GiB "
                 f"(x{act}, {out['plan_activation_phase']}; rise x{rise})" + profile_figures(out.get("profile")))
    return {"status": "FAIL" if why else "PASS", "summary": "; ".join(why) + (": " if why else "") + figures, **out}


def profile_figures(profile: dict | None) -> str:
    """The profiled step in a few words: the classes' shares, largest first (or why there is no profile). A
    profile never fails the check: it says where the time went."""
    if not profile:
        return ""
    if "skipped" in profile or "error" in profile:
        return f"; profile: {profile.get('skipped') or profile['error']}"
    shares = sorted(((v["share"], c) for c, v in profile["classes"].items() if v["share"] >= 0.005), reverse=True)
    return (f"; profile ({profile['activity']} {profile['total_ms']:.1f} ms): "
            + ", ".join(f"{c} {share:.0%}" for share, c in shares))


def kernel_verdict(out: dict, label: str) -> tuple[list[str], str]:
    """(why it fails, figures) for bench.gpu.target.extraction_kernels' results. Fails when transformers
    did not bind fla; when fla's bf16 error against the float32 reference is not of the size of the
    fallback's own bf16 error (mean within 5x, max within 10x: fla keeps more intermediates in bf16, so it
    may round a few times more, while a wrong kernel is off by the size of the output itself); or when fla
    in float32 fails, or is further from the reference than the fallback in bf16 (TF32 dots round far
    less than bf16; a wrong kernel does not)."""
    why = []
    if out["kernels"].get("linear_attention") != "fla":
        try:  # why transformers fell back: it swallows the import error
            import fla  # noqa: F401
            reason = "fla imports; transformers did not bind it"
        except Exception as e:  # noqa: BLE001 - reported, not handled
            reason = f"import fla fails: {type(e).__name__}: {e}"
        why.append(f"{label}: fla is not bound ({out['kernels']}); {reason}")
    elif out["deltanet_max_abs_diff"] == 0:
        why.append(f"{label}: fla and the fallback agree to the bit: the swap to the fallback "
                   f"({out['fallback_swapped']}) changed nothing")
    floor = 1e-6 * out["deltanet_rms"]
    ratio = {k: out[f"deltanet_bound_err_{k}"] / max(out[f"deltanet_fallback_err_{k}"], floor) for k in ("mean", "max")}
    if ratio["mean"] > 5 or ratio["max"] > 10:
        why.append(f"{label}: fla's bf16 error against float32 is {ratio['mean']:.1f}x (mean) / {ratio['max']:.1f}x "
                   f"(max) the fallback's")
    if "float32_error" in out:
        why.append(f"{label}: the bound kernels fail in float32: {out['float32_error']}")
    elif out["deltanet_bound_float32_err_max"] > out["deltanet_fallback_err_max"]:
        why.append(f"{label}: in float32 the bound kernels are {out['deltanet_bound_float32_err_max']:.3g} (max) off "
                   f"the reference, more than the fallback in bf16 ({out['deltanet_fallback_err_max']:.3g})")
    rms = out["features_rms"]
    f32 = out.get("features_max_abs_diff_float32")
    figures = (f"{label} ({out['shape']}): kernels {','.join(f'{k}={v}' for k, v in sorted(out['kernels'].items()))}; "
               f"max feature diff bound vs fallback: bf16 {out['features_max_abs_diff']:.3g}, float32 "
               + (f"{f32:.3g}" if f32 is not None else "n/a") + f" (feature rms {rms:.3g}); DeltaNet output max diff "
               f"{out['deltanet_max_abs_diff'] / out['deltanet_rms']:.3g} of its rms; error vs fp32, bound over "
               f"fallback: {ratio['mean']:.2f}x mean, {ratio['max']:.2f}x max; fallback "
               f"{out['fallback_over_bound']}x slower")
    return why, figures


def tie_margin(dtype: str) -> float:
    """The top-2 logit margin under which a position is a numerical tie: what dflash.evaluate.live takes
    (eval.decode.tie_margin null), 1e-3 for float32 logits and BF16_TIE_MARGIN for bf16 ones."""
    return 1e-3 if dtype == "float32" else BF16_TIE_MARGIN


def committed_tokens(output_ids: list[int], prompt_len: int, logits, margin: float) -> dict:
    """Each token speculative decoding committed (output_ids[prompt_len:]) against the target's argmax given the
    output before it. logits: [n, vocab], row j the target's logits at position prompt_len + j - 1 of one batched
    forward over output_ids (its prediction of output_ids[prompt_len + j]; n = len(output_ids) - prompt_len).
    A position is a tie when its top-2 margin is under `margin`: there a batched and a one-token forward may pick
    either token. Counts over all committed tokens: tokens, ties, non_ties; off_at_ties and off_at_non_ties (a
    committed token that is no argmax there); clear (one whose logit is `margin` or more below the top: no
    rounding flip, a verification bug) and the first few of those."""
    import torch

    x = logits.float()
    committed = torch.as_tensor(output_ids[prompt_len:], device=x.device, dtype=torch.long)
    top = x.topk(2, dim=-1).values
    tie = top[:, 0] - top[:, 1] < margin
    gap = top[:, 0] - x.gather(1, committed[:, None])[:, 0]  # 0 for an argmax (ties at the top included)
    off, clear = gap > 0, gap >= margin
    argmax = x.argmax(-1)
    first = [{"at": j, "token": int(committed[j]), "argmax": int(argmax[j]), "gap": round(float(gap[j]), 4),
              "top2_margin": round(float(top[j, 0] - top[j, 1]), 4)} for j in clear.nonzero()[:5, 0].tolist()]
    return {"tokens": len(committed), "ties": int(tie.sum()), "non_ties": int((~tie).sum()),
            "off_at_ties": int((off & tie).sum()), "off_at_non_ties": int((off & ~tie).sum()),
            "clear": int(clear.sum()), "margin": margin, "first_clear": first}


def lossless_verdict(out: dict) -> dict:
    """Every token each speculative run committed must be the target's argmax given the output before it (one
    batched target forward over the run's own output: `committed_tokens`), in float32 and bf16: a committed token
    whose logit is its tie margin or more below the top FAILs; ties (top-2 margin under it) are counted apart, as
    are the committed tokens that are not the argmax there. float32 must also equal plain greedy decoding exactly;
    divergences from it are listed with the target's top-2 margin there, and a bf16 one fails unless it is a tie
    (or where the outputs differ in length). (Checking only up to the first
    divergence, as before, left 5 of the first H200's 16 bf16 runs checked on 12-34 of their 64 tokens.) Either
    dtype fails when an oracle drafter had nothing accepted (the accepting paths went unexercised)."""
    runs, why, parts = out["runs"], [], []

    def where(r):
        d = r["divergence"]
        margin = "n/a" if d["margin"] is None else f"{d['margin']:.3g}"
        return (name(r) + f" at token {d['at']} (plain {d['plain']}, spec {d['spec']}, margin {margin})")

    def name(r):
        return f"{r['target']}/{r['prompt']}/{r['drafter']}" + (f"/tree{r['tree_budget']}" if r["tree_budget"] else "")

    for dtype in dict.fromkeys(r["dtype"] for r in runs):
        rs = [r for r in runs if r["dtype"] == dtype]
        diverged = [r for r in rs if not r["identical"]]
        oracle = [r["tau"] for r in rs if r["drafter"] == "oracle"]
        checked = [r["tokens"] for r in rs if r.get("tokens")]
        n = {k: sum(t[k] for t in checked) for k in ("tokens", "ties", "non_ties", "off_at_ties", "off_at_non_ties",
                                                      "clear")}
        parts.append(f"{dtype} {len(rs) - len(diverged)}/{len(rs)} identical to plain greedy; every committed token "
                     f"against one batched forward over its output: {n['tokens']} tokens, {n['non_ties']} non-ties "
                     f"({n['off_at_non_ties']} not the argmax), {n['ties']} ties (top-2 margin < {tie_margin(dtype)}; "
                     f"{n['off_at_ties']} not the argmax); oracle tau {sum(oracle) / len(oracle):.2f}"
                     + (f", divergences: {'; '.join(map(where, diverged))}" if diverged else ""))
        if len(checked) < len(rs):
            why.append(f"{dtype}: {len(rs) - len(checked)} runs were not checked token by token")
        if n["clear"]:
            bad = [f"{name(r)} token {c['at']} ({c['token']}, argmax {c['argmax']}, {c['gap']} below it)"
                   for r in rs if r.get("tokens") for c in r["tokens"]["first_clear"]]
            why.append(f"{dtype}: {n['clear']} committed tokens are not the target's argmax by a clear margin (>= "
                       f"{tie_margin(dtype)}): {'; '.join(bad[:5])}")
        if dtype == "float32" and diverged:
            why.append(f"float32: {len(diverged)} runs differ from plain greedy decoding (must be identical)")
        clear = [r for r in diverged if r["divergence"]["margin"] is None  # None: one output cut short
                 or r["divergence"]["margin"] >= tie_margin(dtype)]
        if dtype != "float32" and clear:
            why.append(f"{dtype}: {len(clear)} divergences from plain greedy at a clear logit margin (>= "
                       f"{tie_margin(dtype)}) or in length: not a tie")
        if any(t <= 1 for t in oracle):
            why.append(f"{dtype}: an oracle drafter had nothing accepted")
    kernels = next((r["kernels"] for r in runs if r["target"] == "toy"), {})
    return {"status": "FAIL" if why else "PASS",
            "summary": "; ".join(why) + (": " if why else "") + "; ".join(parts) + f"; toy kernels {kernels}", **out}
