#!/usr/bin/env bash
# DFlash vs DFlash 2 on the default (toy) recipe, 3 seeds each (issue 36):
#   dflash            the default run (`python train.py`, 768 steps)
#   dflash2           drafter.kind=dflash2 at the same shape and steps (the toy drafter: 2 layers, blocks of 16)
#   dflash_eqtime     DFlash given DFlash 2's wall-clock: max_steps = 768 x (DFlash 2's time a step / DFlash's),
#                     the ratio measured on the seed-0 runs of this sweep (their median train/anchors_per_s)
#
#   bash sweeps/dflash2.sh                     # 9 runs into runs/dflash2/ (ROOT=... to move them)
#   python -m dflash.report runs=all root=runs/dflash2 out=reports/dflash2
#
# eval/tau of a dflash2 run is its selector's path (what it drafts), eval/tau_unary its argmax path, and
# eval/tau_oracle the ceiling of the selector (the gold token among the unary top-K at every accepted slot).
# Extra arguments go to every run. Run it alone: two torch processes on 2 cores thrash.
set -euo pipefail
ROOT=${ROOT:-runs/dflash2}
SEEDS=${SEEDS:-"0 1 2"}
PY=${PY:-python}
run() {  # name, overrides...
  local name=$1; shift
  if [ -f "$ROOT/$name/checkpoints/best.json" ] && [ -z "${RERUN:-}" ]; then echo "kept $ROOT/$name"; return; fi
  $PY train.py "$@" run.root="$ROOT" run.name="$name" "${EXTRA[@]}"
}
EXTRA=("$@")
first=${SEEDS%% *}
run "dflash-s$first" train.seed="$first"
run "dflash2-s$first" drafter.kind=dflash2 train.seed="$first"
STEPS=$($PY - "$ROOT/dflash-s$first" "$ROOT/dflash2-s$first" <<'PYEOF'
import json, statistics, sys
rate = [statistics.median(json.loads(l)["train/anchors_per_s"] for l in open(f"{d}/metrics.jsonl")
                          if "train/anchors_per_s" in l) for d in sys.argv[1:]]
print(round(768 * rate[0] / rate[1]))
PYEOF
)
echo "equal wall-clock: DFlash gets $STEPS steps (DFlash 2's time for 768)"
for seed in $SEEDS; do
  [ "$seed" = "$first" ] || run "dflash-s$seed" train.seed="$seed"
  [ "$seed" = "$first" ] || run "dflash2-s$seed" drafter.kind=dflash2 train.seed="$seed"
done
for seed in $SEEDS; do
  run "dflash_eqtime-s$seed" train.seed="$seed" train.max_steps="$STEPS"
done
echo "now: python -m dflash.report runs=all root=$ROOT out=reports/dflash2"
