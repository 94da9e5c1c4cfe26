#!/usr/bin/env bash
# Thinking on and off (issue 51, item 5), on the default (toy) recipe, 3 seeds an arm, equal steps (768):
#   think   trained on one source, the toy prompts rendered with thinking on (the template adds no empty
#           <think></think> block, so the target answers a rendering it was not trained on)
#   plain   one source, thinking off (the rendering the toy target was built with: make run's data)
#   mix     both sources, 60% thinking on / 40% off of every epoch
#   mix_off both sources, 40% thinking on / 60% off (not in the default ARMS: ARMS=mix_off)
# Each run is then evaluated on the same held-out set, the 64 held-out renames rendered both ways (the mixture's
# two views, think/<id> and plain/<id>), with eval.slices=[thinking]: tau per slice, teacher-forced (greedy, the
# decoding walk), into runs/thinking/<arm>-s<seed>/eval/<step>/summary.json.
#
#   bash sweeps/thinking.sh                         # runs into runs/thinking/ (ROOT=..., ARMS="think mix")
#   python sweeps/thinking_table.py runs/thinking   # the table of docs/results/2026-12-05-thinking.md
set -euo pipefail
ROOT=${ROOT:-runs/thinking}
SEEDS=${SEEDS:-"0 1 2"}
ARMS=${ARMS:-"think plain mix"}
CACHE=${CACHE:-cache/toy/thinking}  # a feature cache per arm (a mixture is its own cache); the sources' completions
                                    # (completions.think.jsonl, completions.plain.jsonl) shared by the arms
PY=${PY:-python}
think() { echo "{prompts: 'toy:stdlib', weight: $1, enable_thinking: true, name: think}"; }   # think <weight>
plain() { echo "{prompts: 'toy:stdlib', weight: $1, enable_thinking: false, name: plain}"; }
declare -A SOURCES=([think]="[$(think 0.6)]" [plain]="[$(plain 0.4)]" [mix]="[$(think 0.6), $(plain 0.4)]"
                   [mix_off]="[$(think 0.4), $(plain 0.6)]")
for arm in $ARMS; do
  for seed in $SEEDS; do
    run="$arm-s$seed"
    if [ -f "$ROOT/$run/checkpoints/best.json" ] && [ -z "${RERUN:-}" ]; then
      echo "kept $ROOT/$run"
    else
      $PY train.py "data.sources=${SOURCES[$arm]}" train.seed="$seed" run.root="$ROOT" run.name="$run" \
        features.dir="$CACHE/$arm/features" data.completions.path="$CACHE/completions.jsonl" 'eval.slices=[thinking]' "$@"
    fi
    $PY evaluate.py run.root="$ROOT" run.name="$run" checkpoint=latest "data.sources=${SOURCES[mix]}" \
      features.dir="$CACHE/mix/features" data.completions.path="$CACHE/completions.jsonl" \
      'eval.slices=[thinking]' "$@"
  done
done
echo "now: python sweeps/thinking_table.py $ROOT"
