#!/usr/bin/env bash
# The real-model twin on one GPU (issue 66): SmolLM2-135M-Instruct on ShareGPT, regenerated, extracted, trained and
# evaluated (held-out walk tau, live decoding) at a data size a CPU cannot reach, within about 6 minutes on one H100.
# The machine reaches no network and takes at most 64 MiB a call, so what it reads travels in .real/ (ignored by git)
# in two calls on a warm machine (bench/README.md, "The real-model twin"):
#
#   python -m bench.real_prepare && bash bench/prepare_wheels.sh    # here: .real/ and .whl/ (gguf among the wheels)
#   call 1, carry [.whl, .real/smollm2.gguf.part-a, .real/SHA256SUMS]:  bash bench/gpu_real.sh --install
#   call 2, carry [.real/smollm2.gguf.part-b, .real/sharegpt.json.gz]:  bash bench/gpu_real.sh
#
# Prints PASS|FAIL <stage> lines and writes bench/results/<date>-<gpu>-real.json (and under $OUT when set).
# GPU_REAL_TIMEOUT bounds the run (default 420 s).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi
fi
SITE=${GPU_CHECK_SITE:-$PWD/.whl/site}
if [ ! -d "$SITE" ] && ls .whl/*.whl >/dev/null 2>&1; then
  wheels=$(ls .whl/*.whl | grep -v -e '/fla_core-' -e '/flash_linear_attention-')  # SmolLM2 has no linear layers
  PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check \
    --no-warn-script-location --no-cache-dir --upgrade --target "$SITE" $wheels 2>&1 | tail -3
fi
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PY" -c "import gguf, hydra, omegaconf" 2>/dev/null; then
  echo "FAIL install: gguf, hydra-core or omegaconf missing: carry .whl (bash bench/prepare_wheels.sh)"
  exit 1
fi
if [ "${1:-}" = "--install" ]; then
  echo "PASS install (wheels in $SITE; .real/ now: $(ls .real 2>/dev/null | tr '\n' ' '))"
  exit 0
fi
timeout "${GPU_REAL_TIMEOUT:-420}" "$PY" -m bench.gpu.real "$@"
