"""Live evaluation: real speculative decoding on the held-out prompts, timed side by side with plain decoding
of the target. Greedy decoding (and sampling with eval.decode.verifier=seeded) is checked against plain decoding
token for token; sampling verified by rejection sampling writes other text than plain sampling with the same
seed, so it is not compared token by token: its losslessness is a property of the output distribution,
shown statistically by tests/drafter/decoding/test_lossless_sampling.py.

A conversation (a prompt with later user turns, e.g. MT-Bench's two) is decoded turn by turn, each turn a request
of its own (id <id>:turn2, ...), its earlier answers what the drafted chain decoded before, as the reference
benchmark does; at temperature 0 they are the target's greedy answers, so each turn's prompt is its held-out
item's. eval.turns=first decodes the first turn only. `tau_macro` is the mean over requests of each one's tau.
A tool conversation (dflash.data.tools) is decoded at each of its generation points the same way, the recorded tool
results following the chain's own calls as they follow the target's in the held-out set; a request that holds or
makes tool calls is a tool turn (eval.slices' `tools`).

Cost model, per verification (one target forward each, hybrid targets included: no replay):
`tokens_per_forward` = generated tokens / target forwards (the prompt's included; plain decoding is 1.0),
`tokens_per_verify` = generated tokens / verifications (tau, plus the prefill's token spread over the
blocks), `verify_cost` = tokens the verification forward processes: 1 + drafts for the chain, 1 + N for a
DDTree of N nodes in one sequence (attention-only targets), paths x (1 + depth) for a tree verified as a
batch of its paths (hybrid targets), whose forward also holds one copy of the context's attention KV per
path.

Wall-clock, measured on this machine: each request is decoded plainly, then by each verifier in turn, in one process,
so drift of the machine (clocks, other jobs) falls on all of them alike. `tokens_per_s` is generated tokens over
decoding seconds, the prefill included (plain: eval/live_plain_tokens_per_s), and `speedup` the speculative one over
the plain one. Each speculative decoding's time is split (dflash.drafter.decoding.engine.Clock) into `prefill_s`,
`draft_s` (the drafter's forwards, head, selector and trees), `verify_s` (the target's verification forwards) and
`other_s` (acceptance, cache trimming, masks); `draft_ms_per_step` and `verify_ms_per_step` are per block, and
`verify_over_plain` is a verification's time over one plain decoding step's (eval/live_plain_ms_per_token, the
prompt's forward excluded): the price of verifying a block in plain steps. The serving prediction
(dflash.evaluate.serving) is the cost model's for eval.serving.gpu, from the live tau alone, not a measurement."""

from __future__ import annotations

import itertools
import math
import logging
import time
from dataclasses import replace

import torch

from dflash.config import DataConfig, EvalConfig
from dflash.data.mixture import item_id, views
from dflash.data.prompts import encode, load_prompts, prompt_text, turn_id, turn_messages
from dflash.data.stops import StopStrings
from dflash.data.tools import ToolConversations, involves_tools
from dflash.drafter.decoding.engine import Clock, greedy_generate, speculative_generate
from dflash.drafter.decoding.sampling import Sampling
from dflash.drafter.metrics import ratio_se, tau_histogram
from dflash.errors import LosslessError
from dflash.evaluate.serving import serving_prediction
from dflash.evaluate.slices import slice_metrics, slicers
from dflash.target.features import target_forward
from dflash.target.loading import Target
from dflash.tracking import Progress

log = logging.getLogger(__name__)


TIE_ULPS = 4  # a margin within this many units in the last place of the top logit, in the target's dtype, is a tie


def _top2(target: Target, ids: list[int], position: int) -> tuple[float, float]:
    """(the top-2 margin of the target's logits at `position`, the top logit)."""
    out = target_forward(target, torch.tensor([ids[:position]], device=target.device), [], logits_to_keep=1)
    top = out.logits[0, -1].float().topk(2).values
    return float(top[0] - top[1]), float(top[0])


def ulp(dtype: torch.dtype, value: float) -> float:
    """The spacing of `dtype`'s numbers at |value| (its unit in the last place)."""
    info = torch.finfo(dtype)  # eps: the spacing at 1.0
    return math.ldexp(info.eps, math.frexp(max(abs(value), info.tiny))[1] - 1)


def tie_margin_at(dtype: torch.dtype, top: float) -> float:
    """The margin below which a divergence counts as a numerical tie (eval.decode.tie_margin null): a floor of 1e-3 for
    float32 and 0.1 otherwise, or TIE_ULPS of the dtype's spacing at the top logit, whichever is larger. A bf16 logit
    of 20 is stored to 0.125 (7 mantissa bits): batched and one-token forwards that round it apart differ by that,
    however right the loop."""
    return max(1e-3 if dtype == torch.float32 else 0.1, TIE_ULPS * ulp(dtype, top))


def check_lossless(target: Target, prompt_id: str, plain: list[int], spec: list[int], prompt_len: int,
                   tie_margin: float | None) -> bool:
    """True when equal; False for a divergence at a numerical near-tie (logged); raises otherwise. tie_margin:
    eval.decode.tie_margin where set; None judges by the target's dtype at the logit there (tie_margin_at)."""
    if plain == spec:
        return True
    pos = next((i for i, (a, b) in enumerate(zip(plain, spec)) if a != b), min(len(plain), len(spec)))
    margin, top = _top2(target, plain, pos) if pos < min(len(plain), len(spec)) else (float("inf"), 0.0)
    if tie_margin is None:
        tie_margin = tie_margin_at(target.dtype, top)
    where = (f"prompt {prompt_id}: speculative decoding diverged from plain decoding at generated token "
             f"{pos - prompt_len} (plain {plain[pos:pos + 1]}, speculative {spec[pos:pos + 1]}; lengths "
             f"{len(plain) - prompt_len} vs {len(spec) - prompt_len})")
    if margin < tie_margin:
        log.warning("%s, where the target's top-2 logits differ by only %.2e: a numerical tie between batched "
                    "and one-token forwards, not a verification bug", where, margin)
        return False
    raise LosslessError(f"{where}; the target's top-2 logit margin there is {margin:.3g}, above the {tie_margin:.3g} "
                        f"that counts as a numerical tie (eval.decode.tie_margin). The "
                        f"decoding loop is not lossless: this is a bug, please report it")


def measured_on(device) -> dict:
    """What the live timings were measured on: the device's kind and name (a CPU's with its threads), and whether
    the clocks synchronised it (CUDA)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {"device": "cuda", "name": torch.cuda.get_device_name(device), "synchronized": True}
    threads = torch.get_num_threads()
    return {"device": device.type, "name": f"{device.type} ({threads} thread{'s' if threads > 1 else ''})",
            "synchronized": False}


def verifier_args(budget, tree: str, beam: int) -> dict:
    """speculative_generate's arguments for one of live_eval's verifiers (tree budget or None, tree kind or "beam":
    DFlash 2's chain from a beam of width `beam`)."""
    return {"tree_budget": budget, "tree": "marginal" if tree == "beam" else tree,
            "selector_beam": beam if tree == "beam" else 1}


def warm_up(drafter, target: Target, ids: torch.Tensor, tokens: int, verifiers: list[tuple], verifier: str,
            beam: int = 1, **knobs) -> None:
    """Decode `ids` for `tokens` tokens plainly and by each (tree budget, tree) of `verifiers`, discarding the
    output: the first forwards of a process pay the kernels' compiles and autotuning (on an H200, fla's autotuning
    made a hybrid target's first forward 45 s and its first live decoding 14.5 s against 1.9 s for the next), which
    the timed decoding after it then does not count."""
    greedy_generate(target, ids, tokens, **knobs)
    for budget, tree in verifiers:
        speculative_generate(drafter, target, ids, tokens, verifier=verifier, **verifier_args(budget, tree, beam),
                             **knobs)


def live_eval(cfg: EvalConfig, data: DataConfig, drafter, target: Target) -> tuple[list[dict], dict]:
    """Per-step records and a summary of live decoding (the eval group's held-out prompts, rendered as the data
    group says): the drafted chain and each DDTree budget, on every target (hybrid ones verify a tree as a batch of
    its paths, dflash.drafter.decoding.verify)."""
    dec = cfg.decode
    prompts = load_prompts(cfg.prompts, limit=cfg.max_prompts)
    stops, strings = target.stop_token_ids(), StopStrings(target.tokenizer, data.completions.stop)
    sampling = Sampling(dec.temperature, dec.top_p, dec.top_k)
    compared = sampling.greedy or dec.verifier == "seeded"  # token for token equal to plain decoding
    knobs = {"temperature": dec.temperature, "top_p": dec.top_p, "top_k": dec.top_k}
    selector = {"selector_draw": dec.selector_draw, "selector_truncation": dec.selector_truncation}  # DFlash 2's draws
    # verifiers: the chain, each DDTree budget, and for DFlash 2 each budget's tree from the selector's pairwise scores
    # and, with eval.decode.selector_beam > 1, the chain a beam over them finds
    dflash2 = drafter.candidate_selector is not None
    budgets = [(None, "marginal"), *[(b, "marginal") for b in cfg.ddtree_budgets],
               *([(None, "beam")] if dflash2 and dec.selector_beam > 1 else []),
               *[(b, "pairwise") for b in cfg.ddtree_budgets if dflash2]]
    fields = ("tokens", "forwards", "verifies", "verify_tokens", "time")
    # one clock per verifier, its parts summed over the requests (dflash.drafter.decoding.engine.Clock)
    totals = {b: {**dict.fromkeys(fields, 0), "taus": [], "per_prompt": [], "clock": Clock(target.device)}
              for b in budgets}
    records, plain_time, plain_tokens, ties, requests, prompt_tokens = [], 0.0, 0, 0, 0, 0
    plain_clock = Clock(target.device)
    rendered = [(replace(source, name=name), source.data) for name, source in views(data)]  # a mixture's renderings

    def render(how):  # the text of messages (and tools) as the chat template renders them for `how`
        return lambda messages, tools: prompt_text(target.tokenizer, messages, how.chat_template, how.enable_thinking,
                                                   how.chat_template_kwargs, tools)

    def request(prompt, messages: list[dict], how) -> torch.Tensor:  # the ids [1, P] a turn continues
        text = render(how)(messages, prompt.tools)
        return torch.tensor([encode(target.tokenizer, text)], device=target.device)

    # tool conversations, per rendering: their generation points, carried on by the chain's own calls
    talks = {view.name: ToolConversations(prompts, cfg.prompts, render(how), "all_turns" if cfg.turns == "all"
                                          else "first_turn", data.tools.keep_results, data.skip_bad_records)
             for view, how in rendered}
    turns = {(view.name, p.id): talks[view.name].turns(p) if cfg.turns == "all" else min(1, talks[view.name].turns(p))
             for view, _ in rendered for p in prompts}
    if dec.warmup_tokens and prompts:
        warm_up(drafter, target, request(prompts[0], prompts[0].messages, data),
                min(dec.warmup_tokens, cfg.max_new_tokens), budgets, dec.verifier, dec.selector_beam, seed=dec.seed,
                **knobs)
    progress = Progress(sum(turns.values()), "live eval", "requests")
    for (view, how), (n, prompt) in itertools.product(rendered, enumerate(prompts)):
        answers = []  # the conversation's earlier answers: what the drafted chain decoded (the reference's way)
        talk = talks[view.name]
        for turn in range(turns[view.name, prompt.id]):
            rid = item_id(view, turn_id(prompt.id, turn))
            messages = talk.messages(prompt, turn) if prompt.id in talk.steps else turn_messages(prompt, turn, answers)
            if messages is None:  # a tool conversation that ended at a call other than the recorded one
                break
            ids, first = request(prompt, messages, how), len(records)  # first: this request's first record
            requests, prompt_tokens = requests + 1, prompt_tokens + ids.shape[1]
            t0 = time.perf_counter()
            seed = dec.seed * 100_003 + n + 1_000_003 * turn
            plain = greedy_generate(target, ids, cfg.max_new_tokens, seed=seed, stop_token_ids=stops,
                                    stop_strings=strings, clock=plain_clock, **knobs)
            plain_time += time.perf_counter() - t0
            plain_tokens += plain.shape[1] - ids.shape[1]
            for budget, tree in budgets:
                tot = totals[budget, tree]
                t0 = time.perf_counter()
                res = speculative_generate(drafter, target, ids, cfg.max_new_tokens, stop_token_ids=stops,
                                           stop_strings=strings, seed=seed, verifier=dec.verifier,
                                           clock=tot["clock"], **verifier_args(budget, tree, dec.selector_beam),
                                           **knobs, **selector)
                tot["time"] += time.perf_counter() - t0
                if compared:
                    ties += not check_lossless(target, rid, plain[0].tolist(), res.output_ids[0].tolist(),
                                               ids.shape[1], dec.tie_margin)
                if budget is None and tree == "marginal":
                    new = res.output_ids[0, ids.shape[1]:].tolist()
                    answers.append(target.tokenizer.decode(new, skip_special_tokens=True))
                    cut = len(new) >= cfg.max_new_tokens and (not new or new[-1] not in stops)
                tot["tokens"] += res.output_ids.shape[1] - ids.shape[1]
                tot["forwards"] += res.target_forwards
                tot["verifies"] += len(res.acceptance_lengths)
                tot["verify_tokens"] += res.verify_tokens
                tot["taus"] += res.acceptance_lengths
                tot["per_prompt"].append((sum(res.acceptance_lengths), len(res.acceptance_lengths)))
                anchor = ids.shape[1]  # each block's anchor: the prefill's token, then where the last one stopped
                for step, (tau, drafts) in enumerate(zip(res.acceptance_lengths, res.draft_tokens)):
                    records.append({"prompt_id": rid, "tree_budget": budget, "tree": tree, "step": step,
                                    "anchor": anchor, "tau": tau, "draft_tokens": drafts})
                    anchor += tau
            if involves_tools(messages, answers[-1]):
                for record in records[first:]:
                    record["tools"] = True
            if prompt.id in talk.steps and not talk.answered(prompt, turn, rid, answers[-1], cut):
                break  # its call is not valid JSON: skipped (data.skip_bad_records)
            progress.update()
    progress.close()
    plain_parts = plain_clock.seconds
    metrics = {"eval/live_plain_s": plain_time, "eval/live_prompts": len(prompts),
               "eval/live_requests": requests,
               "eval/live_ties": ties,
               "eval/live_tokens": totals[None, "marginal"]["tokens"],
               "eval/live_plain_tokens": plain_tokens,
               "eval/live_plain_tokens_per_s": plain_tokens / max(plain_time, 1e-9),
               "eval/live_plain_prefill_s": plain_parts.get("prefill", 0.0),
               # a token's forward and sampling, the prompt's forward left out: the unit a verification is priced in
               "eval/live_plain_ms_per_token": 1e3 * plain_parts.get("decode", 0.0)
               / max(1, plain_clock.counts.get("decode", 0))}
    for (budget, tree), tot in totals.items():
        prefix = ("eval/live_beam_" if tree == "beam" else "eval/live_" if budget is None else
                  f"eval/live_ddtree@{budget}_" if tree == "marginal" else f"eval/live_ddtree_pair@{budget}_")
        parts, steps = tot["clock"].seconds, max(1, tot["verifies"])
        rate = tot["tokens"] / max(tot["time"], 1e-9)
        verify_ms = 1e3 * parts.get("verify", 0.0) / steps
        metrics.update({
            f"{prefix}tau": sum(tot["taus"]) / max(1, len(tot["taus"])),
            f"{prefix}tau_se": ratio_se(tot["per_prompt"]),
            # the mean over requests of each one's tau (each turn of a conversation is a request): the reference
            # benchmark's average (dflash.evaluate.suites)
            f"{prefix}tau_macro": sum(t / c for t, c in tot["per_prompt"] if c) / max(1, len(tot["per_prompt"])),
            f"{prefix}tokens_per_forward": tot["tokens"] / max(1, tot["forwards"]),
            f"{prefix}tokens_per_verify": tot["tokens"] / max(1, tot["verifies"]),
            f"{prefix}verify_cost": tot["verify_tokens"] / max(1, tot["verifies"]),
            # throughput over throughput, not time over time: sampled by rejection, the two decodings write other
            # answers (of other lengths); greedy, they are the same tokens and the two ratios agree
            f"{prefix}speedup": rate / max(metrics["eval/live_plain_tokens_per_s"], 1e-9),
            f"{prefix}spec_s": tot["time"],
            f"{prefix}tokens_per_s": rate,
            **{f"{prefix}{part}_s": parts.get(part, 0.0) for part in ("prefill", "draft", "verify", "other")},
            f"{prefix}draft_ms_per_step": 1e3 * parts.get("draft", 0.0) / steps,
            f"{prefix}verify_ms_per_step": verify_ms,
            f"{prefix}other_ms_per_step": 1e3 * parts.get("other", 0.0) / steps,
            f"{prefix}verify_over_plain": verify_ms / max(metrics["eval/live_plain_ms_per_token"], 1e-9),
        })
    chain = [(r, r["tau"]) for r in records if r["tree_budget"] is None and r["tree"] == "marginal"]
    metrics.update(slice_metrics(chain, slicers(data, cfg), "eval/live"))
    answer = totals[None, "marginal"]["tokens"] / max(1, requests)  # the model's request: mean prompt, mean answer
    served = serving_prediction(cfg.serving, drafter, target, metrics["eval/live_tau"],
                                prompt_tokens / max(1, requests) + answer / 2, answer) if requests else {}
    metrics.update(served.get("metrics", {}))
    summary = {"metrics": metrics, "tau_histogram": tau_histogram(totals[None, "marginal"]["taus"], drafter.block_size),
               "block_size": drafter.block_size, "ddtree_budgets": list(cfg.ddtree_budgets), "mode": "live",
               "tree_verification": target.tree_verification(),
               "sampling": {**knobs, **selector, "verifier": dec.verifier, "seed": dec.seed},
               "compared_with_plain": compared, "measured_on": measured_on(target.device),
               **({"serving": served["serving"]} if served else {})}
    return records, summary
