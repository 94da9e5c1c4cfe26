#!/usr/bin/env bash
# Loss and optimizer arms on the default (toy) recipe, 3 seeds each, equal steps (issue 30):
#   decay_ce (the default), dpace (per-anchor normalisation), dpace_w (sum-of-weights normalisation),
#   kl (distillation on the target's distribution; online: the feature cache holds no logits), muon.
#
#   bash sweeps/losses_optim.sh                    # 15 runs into runs/losses/ (ROOT=... to move them)
#   python -m dflash.report runs=all root=runs/losses out=reports/losses
#
# The report's first table has one row per run; its "Per arm" table gives, per arm (the config keys that
# differ, the seed aside), the mean and sample sd over the 3 seeds of the final held-out tau, acc@1 and
# ddtree@8 (and the best tau). An arm beats decay_ce when its mean tau exceeds decay_ce's by more than twice
# the larger of the two sds. Arms are listed by hand, not as a W&B grid: a grid would cross every loss with
# every optimizer, and the kl arm alone needs train.mode=online. Extra arguments go to every run
# (e.g. `bash sweeps/losses_optim.sh train.max_steps=200 logger=wandb`).
set -euo pipefail
ROOT=${ROOT:-runs/losses}
SEEDS=${SEEDS:-"0 1 2"}
declare -A ARMS=(
  [decay_ce]="loss=decay_ce"
  [dpace]="loss=dpace loss.normalize=anchor"
  [dpace_w]="loss=dpace loss.normalize=weights"
  [kl]="loss=kl train.mode=online"
  [muon]="optim=muon"
)
for arm in decay_ce dpace dpace_w kl muon; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2086  # the arm's overrides are words
    python train.py ${ARMS[$arm]} train.seed="$seed" run.root="$ROOT" run.name="$arm-s$seed" "$@"
  done
done
echo "now: python -m dflash.report runs=all root=$ROOT out=reports/losses"
