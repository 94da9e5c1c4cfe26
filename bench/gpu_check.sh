#!/usr/bin/env bash
# The prepared GPU check, for one CUDA machine (an H200: within 10 minutes), unattended, from a fresh
# clone: installs what is missing, then prints one `PASS|FAIL|SKIP <check> ...` line per check:
#   install          dflash's missing dependencies: from .whl/ when it is there (offline), into a folder
#                    put on PYTHONPATH (.whl/site), never into the machine's own environment
#   flex_train_step  compiled flex training steps at Qwen3-8B drafter size over up to 8 lengths (3072 and
#                    4096 first): tokens/s, MFU against the bf16 peak, peak memory; FAIL when dynamo
#                    compiles again for a shape it compiled before
#   qwen3_6_step     the Qwen3.6-27B drafter's compiled flex step at 3072 tokens and 512 anchors: tokens/s,
#                    MFU, graphs, peak memory of the step and of its forward and backward alone; FAIL when
#                    the plan's estimate of either is more than 15% off it
#   qwen3_6_dflash2_step  the same for the published 27B DFlash 2 drafter, also alone
#   checkpointing_modes  the Qwen3.6-27B step's forward and backward with no, selective and full gradient
#                    checkpointing, alone: time and peak against the plan's; FAIL when a peak is more than 15%
#                    off the plan's or selective is not faster than full (train.gradient_checkpointing=auto's order)
#   compiled_layers  the same step eager and with train.compile=layers, alone: the speed-up, the compile's seconds
#                    and graphs; FAIL when the loss is not eager's or a timed step (or another length of the same
#                    padded shape) compiles again
#   vllm_dflash2     DFlash 2 and mixed sliding/full drafters served by vLLM against our live evaluation (what
#                    vLLM's CPU build in `make engines` refuses); SKIP where vllm is not installed
#   serving_sweep    `make serving` on the GPU: throughput with and without a drafter at concurrency 1-32 in
#                    vLLM, and the cost model's prediction of the ratio; SKIP where vllm is not installed
#   gpu_tests        pytest -m gpu
#   autocast_loss    bf16 autocast against float32 on the same batch: loss and gradient direction
#   fla_kernels      hybrid targets (tiny, and with the real head dims of 128) with the fla kernels against
#                    the PyTorch fallback, in bf16 and float32
#   live_lossless    every token speculative decoding commits is the target's argmax over its own output (ties,
#                    top-2 margins under 1e-3 / 0.1 in bf16, counted apart); float32 equals plain greedy exactly
# and writes bench/results/<date>-<gpu>-gpu-check.json after every check (also under $OUT when set, with
# the checks' logs). Without CUDA the GPU-only checks print SKIP with the reason and the rest run small.
#
#   bash bench/prepare_wheels.sh      # once, on a machine with network, for a GPU machine without it
#   bash bench/gpu_check.sh           # exit status 1 when a check FAILed
#
# PYTHON picks the interpreter (default: .venv/bin/python when there, else python3); GPU_CHECK_BUDGET the
# seconds for all checks after the install (default 480); GPU_CHECK_SITE the folder wheels install into
# (default .whl/site, else $TMPDIR/dflash-gpu-check-site when .whl is not writable).
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the compile caches in the checkout (build/ is ignored by git), so a later run of the check on this machine, and
# every check's process, finds the kernels compiled and autotuned; values exported before are kept
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/build/compile-cache/triton}
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$PWD/build/compile-cache/inductor}
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi
fi
start=$(date +%s)
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

# wheels go into a folder of their own, first on PYTHONPATH (the machine's environment may be read-only);
# one installed by an earlier run is used as it is
SITE=${GPU_CHECK_SITE:-$PWD/.whl/site}
if [ -z "${GPU_CHECK_SITE:-}" ] && [ -d .whl ] && [ ! -w .whl ]; then SITE=${TMPDIR:-/tmp}/dflash-gpu-check-site; fi
[ -d "$SITE" ] && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"

# One interpreter start for: the versions, whether CUDA is there, whether dflash is installed
# (looked up without this checkout on sys.path) and which packages are missing. fla is wanted only
# where CUDA is: on a CPU machine its presence makes transformers bind GPU kernels. No check needs wandb.
needed="hydra:hydra-core omegaconf:omegaconf transformers:transformers accelerate:accelerate"
probe='import importlib.util as u, os, sys
import torch
cuda = torch.cuda.is_available()
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if cuda else "(no GPU)", file=sys.stderr)
wanted = sys.argv[1:] + (["fla:flash-linear-attention"] if cuda else [])
sys.path = [p for p in sys.path if p not in ("", os.getcwd())]
missing = [p.split(":")[1] for p in wanted if u.find_spec(p.split(":")[0]) is None]
print(int(cuda), int(u.find_spec("dflash") is not None), *missing)'
if ! found=$("$PY" -c "$probe" $needed); then
  echo "FAIL install $PY cannot import torch: install torch for this machine first"
  exit 1
fi
read -r cuda dflash_installed missing <<<"$found"
[ "$cuda" = 1 ] && needed="$needed fla:flash-linear-attention"

install="PASS"
note="nothing missing"
[ -d "$SITE" ] && note="nothing missing (with $SITE on PYTHONPATH)"
if [ -n "$missing" ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    # every wheel of the prepared closure (bench/prepare_wheels.sh), without resolving, so the
    # machine's own torch, transformers and triton stay as they are; fla's only where CUDA is
    wheels=$(ls .whl/*.whl)
    [ "$cuda" = 1 ] || wheels=$(echo "$wheels" | grep -v -e '/fla_core-' -e '/flash_linear_attention-')
    mkdir -p "$SITE"
    PIP_ROOT_USER_ACTION=ignore "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --no-warn-script-location --no-cache-dir \
      --upgrade --target "$SITE" $wheels 2>&1 | tail -5
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
    note="installed $missing from .whl (offline) into $SITE, on PYTHONPATH"
  else
    # no prepared wheels: the package index, into the environment (needs network and a writable one)
    "$PY" -m pip install -q --disable-pip-version-check $missing 2>&1 | tail -5
    note="installed $missing from the package index (no .whl: bash bench/prepare_wheels.sh makes it)"
  fi
  broken=$("$PY" -c 'import importlib, sys
for p in sys.argv[1:]:
    try:
        importlib.import_module(p.split(":")[0])
    except Exception as e:
        name = p.split(":")[1]
        print(f"{name} does not import ({type(e).__name__}: {e})", end="; ")' $needed)
  [ -n "$broken" ] && { install="FAIL"; note="$note; $broken"; }
fi
if [ "$cuda" = 1 ] && ! "$PY" -c "import causal_conv1d" 2>/dev/null; then
  note="$note; causal-conv1d absent (a CUDA build, not made offline): the Gated DeltaNet convolution runs in PyTorch"
fi
# dflash itself runs from this checkout (no build step, so no setuptools version to depend on)
if [ "$dflash_installed" != 1 ]; then
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  note="$note; dflash from this checkout (PYTHONPATH)"
fi
echo "$install install $note ($(( $(date +%s) - start )) s)"
export GPU_CHECK_INSTALL="$install $note"

"$PY" -m bench.gpu.checks --budget "${GPU_CHECK_BUDGET:-480}" ${GPU_CHECK_RESULTS:+--results "$GPU_CHECK_RESULTS"}
status=$?
echo "gpu_check.sh: $(( $(date +%s) - start )) s in all"
exit $status
