#!/usr/bin/env bash
# The prepared GPU check: gpu-marked tests + GPU benchmarks, no network, under 8 minutes.
# Run from the repository root on a CUDA machine with dflash installed (and, for the kernel
# comparison, flash-linear-attention + causal-conv1d: pip install -e ".[gpu]").
#   bash bench/gpu_check.sh            # results in bench/results/<date>-<gpu>.json
set -uo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=disabled PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || { echo "no GPU"; exit 1; }
python -c "import torch; assert torch.cuda.is_available(), 'torch has no CUDA'; print('torch', torch.__version__)"
status=0
timeout 240 python -m pytest -q -m gpu tests 2>&1 | tee "$out/gpu_tests.log" || status=1
timeout 240 python -m bench --quick --only gpu_train_step gpu_extraction_kernels train_step extraction live \
  --out "$out/$(date +%Y-%m-%d)-$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -c 'A-Za-z0-9\n' '-' | tr 'A-Z' 'a-z').json" \
  2>&1 | tee "$out/gpu_bench.log" || status=1
exit $status
