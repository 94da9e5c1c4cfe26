"""What a live evaluation's tau buys when served: the serving cost model (dflash.plan.serving) applied to the
drafter and target just evaluated, at eval.serving.concurrency on eval.serving.gpu's roofline.

The model takes the measured chain tau (eval/live_tau), the requests' mean context (prompt plus half the answer:
the KV cache a decode step reads, on average) and mean answer length, and the two models' shapes as the plan
counts them (parameters a token runs through, weights and KV bytes in bf16). It is a model of a GPU engine, not a
measurement of this machine: `python -m bench.serving` measures a sweep in vLLM, docs/results/2026-12-05-serving.md
says how close the model came."""

from __future__ import annotations

from dflash.config import ServingModelConfig
from dflash.plan.configured import drafter_shape
from dflash.plan.serving import predict


def serving_prediction(cfg: ServingModelConfig, drafter, target, tau: float, context: float, tokens: float) -> dict:
    """{metrics: eval/live_serving@<C>_speedup, serving: the prediction (marked predicted: true) and its
    assumptions}; empty where eval.serving.concurrency is []."""
    conc = list(cfg.concurrency)
    if not conc or target.model is None:
        return {}
    text = target.config
    shape = drafter_shape(drafter, text.vocab_size, bool(getattr(text, "tie_word_embeddings", False)),
                          (target.model, text))
    out = predict(shape, text, tau, cfg.gpu, conc, max(1, round(context)), max(2.0, tokens))
    # `predicted` says, in summary.json too, that these figures come from the model and not from this machine: a run
    # on a CPU once printed an H200's speedup that readers took for its result
    return {"metrics": {f"eval/live_serving@{c}_speedup": r for c, r in out["speedup"].items()},
            "serving": {**out, "predicted": True, "by": "dflash.plan.serving", "tau_from": "eval/live_tau",
                        "block_size": shape.block_size, "layers": shape.layers}}
