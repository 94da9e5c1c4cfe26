#!/usr/bin/env bash
# DFlash 2's selector trained the ways the public trainers train it, and regularised (issue 50), on the default (toy)
# recipe, 3 seeds an arm, equal steps (768): every arm is `python train.py drafter.kind=dflash2` plus
#   ours           the defaults before issue 50: unary scores detached, gold injected, normal codebooks, decay weights
#   speculators    coupled gradients (the unary logits get the selector's gradient), gold injected: the default now
#   specforge      coupled, strict gold (no loss where the unary top-K misses it), zero successor codebook (step 0 =
#                  DFlash's unary path), the selector's weight 0 for 10% of the steps then ramped over 20%
#                  (SpecForge's ratios are keys of its trainer; these values are ours)
#   decay          the default (coupled) + AdamW weight decay 1.0 on the two codebooks (decoupled decay shrinks a
#                  weight by about lr x decay x steps x 0.5 = 0.77 x decay over the toy's 768 cosine steps at lr 2e-3:
#                  0.1, ten times optim.weight_decay, would take 8% off, 1.0 about half)
#   dropout        the default + dropout 0.2 on the predecessor's codebook row
#   rank64         the default at selector rank 64 (a quarter of the codebooks' parameters)
#   decay_dropout  the default + both (decay 1.0, dropout 0.2)
#   topk8          the default with 8 candidates, not 16 (fewer to overrule a right unary choice; a lower ceiling)
#   weight2        the default with the selector's CE at weight 2 (loss.selector.weight)
#   span           the default with both codebooks kept in the span of the target's token vectors (embeddings for
#                  the predecessor's, head rows for the successor's; loss.selector.span=embedding)
#   spanpred       the same for the predecessor's codebook alone (loss.selector.span=predecessor)
# and the DFlash arm of the same seeds (drafter.kind=dflash) for the prompt-by-prompt comparison.
#
#   bash sweeps/selector.sh                      # runs into runs/selector/ (ROOT=..., ARMS="ours specforge")
#   python sweeps/selector_table.py runs/selector   # the table of docs/results/2026-12-03-dflash2.md
#
# Each run's final in-run evaluation (greedy, the 64 held-out prompts) gives the walk tau, every-anchor tau,
# tau_unary and tau_oracle; its windows the served-semantics train/tau, train/oracle/tau and train/topk_recall.
# Run it alone for the s/step column (two torch processes on 2 cores thrash); tau does not depend on it.
set -euo pipefail
ROOT=${ROOT:-runs/selector}
SEEDS=${SEEDS:-"0 1 2"}
ARMS=${ARMS:-"dflash ours speculators specforge decay dropout rank64 decay_dropout topk8 weight2 span spanpred"}
PY=${PY:-python}
declare -A OVERRIDES=(
  [dflash]="drafter.kind=dflash"
  [ours]="drafter.kind=dflash2 loss.selector.gradient=detach_unary"
  [speculators]="drafter.kind=dflash2 loss.selector.gradient=coupled"
  [specforge]="drafter.kind=dflash2 loss.selector.gradient=coupled loss.selector.gold=strict loss.selector.init=zero loss.selector.warmup_ratio=0.1 loss.selector.ramp_ratio=0.2"
  [decay]="drafter.kind=dflash2 loss.selector.decay=1.0"
  [dropout]="drafter.kind=dflash2 loss.selector.dropout=0.2"
  [rank64]="drafter.kind=dflash2 drafter.selector_rank=64"
  [decay_dropout]="drafter.kind=dflash2 loss.selector.decay=1.0 loss.selector.dropout=0.2"
  [topk8]="drafter.kind=dflash2 drafter.selector_top_k=8"
  [weight2]="drafter.kind=dflash2 loss.selector.weight=2.0"
  [span]="drafter.kind=dflash2 loss.selector.span=embedding"
  [spanpred]="drafter.kind=dflash2 loss.selector.span=predecessor"
)
for arm in $ARMS; do
  for seed in $SEEDS; do
    if [ -f "$ROOT/$arm-s$seed/checkpoints/best.json" ] && [ -z "${RERUN:-}" ]; then echo "kept $ROOT/$arm-s$seed"; continue; fi
    # shellcheck disable=SC2086  # the arm's overrides are words
    $PY train.py ${OVERRIDES[$arm]} train.seed="$seed" run.root="$ROOT" run.name="$arm-s$seed" "$@"
  done
done
