#!/usr/bin/env bash
# One call on the GPU machine (no network): unpack the wheel bundle, run `bench/bench_train_gpu.py`
# on both backends with a profiled step each, then, while the time budget allows, Unsloth with its
# CUDA-graph decode as its own row. Everything it measures is written under OUT_DIR.
#
#   bash bench/gpu_session.sh BUNDLE_DIR OUT_DIR [SECONDS]     # BUNDLE_DIR from ../shared/gpu/make-bundle.sh
#
# SECONDS (default 540) is the whole call's budget: each backend gets a share of it and is stopped,
# with what it printed kept, if it overruns, so one slow or broken backend does not lose the other.
# On an H100 (2026-11-26) the start and transfers took ~36 s beyond the command; unpacking 7 s; Unsloth ~90 s to load
# and play its warm-up step, 14 s a step after (TRL ~60 s, 20 s); the profiled step 22-32 s, and
# reading its trace longer than 45 s. Give the call's timeout_s some 60 s more than SECONDS.
set -uo pipefail
bundle=${1:?usage: gpu_session.sh BUNDLE_DIR OUT_DIR [SECONDS]}
out=${2:?usage: gpu_session.sh BUNDLE_DIR OUT_DIR [SECONDS]}
budget=${3:-540}
start=$SECONDS
mkdir -p "$out" /tmp/site
tar -xJf "$bundle/site.tar.xz" -C /tmp/site || exit 3
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 \
  HF_DATASETS_OFFLINE=1 UNSLOTH_DISABLE_STATISTICS=1 TRL_EXPERIMENTAL_SILENCE=1
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  python3 -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "unpacked the bundle in $((SECONDS - start)) s"; } 2>&1 | tee "$out/machine.txt"
per_backend=$(( (budget - (SECONDS - start) - 30) / 2 ))
python3 bench/bench_train_gpu.py --steps 2 --model-dir /tmp/bench-model --backend-timeout "$per_backend" \
  --profile-dir "$out" --out "$out/bench_train_gpu.json" 2>&1 | tee "$out/bench_train_gpu.log"
left=$(( budget - (SECONDS - start) ))
echo "$left s of the budget left after both backends"
if [ "$left" -gt 150 ]; then
  UNSLOTH_DECODE_CUDA_GRAPHS=1 python3 bench/bench_train_gpu.py --backends unsloth --steps 2 \
    --model-dir /tmp/bench-model --backend-timeout $(( left - 20 )) \
    --out "$out/bench_train_gpu_cuda_graphs.json" 2>&1 | tee "$out/bench_train_gpu_cuda_graphs.log"
fi
