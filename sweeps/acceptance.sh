#!/usr/bin/env bash
# The acceptance losses (issue 37) against decayed CE and KL on the default (toy) recipe, 3 seeds each, equal
# steps: tv (1 - alpha per slot), nla (-log alpha), expected_tau (the block's expected accepted length), all at
# loss.temperature=1 and online (they need the target's distribution; offline: features.topk_logits=64).
# decay_ce trains offline on the bf16 feature cache, as the default run does; decay_ce_online trains it online, on
# the float32 features the other arms train on, so that no comparison crosses feature kinds (issue 38).
#
#   bash sweeps/acceptance.sh                      # runs into runs/acceptance/ (ROOT=..., ARMS="tv nla" to narrow)
#   bash sweeps/acceptance.sh train.max_steps=200  # extra arguments go to every run
#
# Each run's in-run evaluation is greedy (eval/tau); the expected acceptance at temperature 1 is then measured
# on each final checkpoint by `python evaluate.py ... eval.decode.temperature=1.0` (loop at the end), so one table has
# the walk tau at T = 0 and the expected walk tau at T = 1 per arm.
set -euo pipefail
ROOT=${ROOT:-runs/acceptance}
SEEDS=${SEEDS:-"0 1 2"}
ARMS=${ARMS:-"decay_ce decay_ce_online kl tv nla expected_tau"}
declare -A OVERRIDES=(
  [decay_ce]="loss=decay_ce"
  [decay_ce_online]="loss=decay_ce train.mode=online"
  [kl]="loss=kl train.mode=online"
  [tv]="loss=tv loss.temperature=1.0 train.mode=online"
  [nla]="loss=nla loss.temperature=1.0 train.mode=online"
  [expected_tau]="loss=expected_tau loss.temperature=1.0 train.mode=online"
)
for arm in $ARMS; do
  for seed in $SEEDS; do
    # shellcheck disable=SC2086  # the arm's overrides are words
    python train.py ${OVERRIDES[$arm]} train.seed="$seed" run.root="$ROOT" run.name="$arm-s$seed" "$@"
    python evaluate.py run.root="$ROOT" run.name="$arm-s$seed" checkpoint=latest eval.decode.temperature=1.0
  done
done
