#!/usr/bin/env bash
# One-shot accelerator check, under 10 minutes on one CUDA or Ascend device:
#   (a) the test suite's fast tests with the device selected (TREX_DEVICE), and the FlexAttention
#       backward against the reference (FlexAttention has no CPU backward, so only here);
#   (b) a V4-Flash-shaped training step, eager vs compiled, in bf16, with MFU (bench/accelerator.py);
#   (c) recipes/fidelity_default.toml on the device in bf16 against its CPU fp32 golden file, and against
#       the same recipe on CPU in bf16 (the device's own difference), profile vendor;
# then writes every figure into docs/benchmarks.md (bench/accelerator.py report).
#
#   bash bench/accelerator.sh                   # the device torch.accelerator finds
#   TREX_DEVICE=npu OUT=/tmp/acc bash bench/accelerator.sh
#   PYTHON=python3.12 bash bench/accelerator.sh  # an interpreter whose torch is the accelerator build
#
# Uses the interpreter's torch (install the accelerator build first, docs/install.md) and installs trex
# into it without dependencies when it is not importable. Each part has its own time limit and the
# script goes on after a failed part; the exit status is the number of parts that failed.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-runs/accelerator}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"$PYTHON" -c "import trex" 2>/dev/null || "$PYTHON" -m pip install -q --no-deps -e . || exit 1
DEVICE=${TREX_DEVICE:-$("$PYTHON" -c "from trex import device; print(device.detect().type)")}
echo "accelerator check on device type $DEVICE, outputs in $OUT"
"$PYTHON" -m trex doctor --format json > "$OUT/env.json" 2>/dev/null || echo '{}' > "$OUT/env.json"
failed=0

echo "== (a) tests with TREX_DEVICE=$DEVICE"
TREX_DEVICE=$DEVICE timeout 240 "$PYTHON" -m pytest -q -x -m "not slow" -p no:cacheprovider 2>&1 | tee "$OUT/tests.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))
timeout 120 "$PYTHON" -m trex.kernels.flex_attention "$DEVICE" 2>&1 | tee "$OUT/flex.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))

echo "== (b) V4-Flash-shaped step, eager vs compiled, bf16"
timeout 300 "$PYTHON" bench/accelerator.py step --device "$DEVICE" --dtype bf16 --out "$OUT/step.json" \
  || failed=$((failed + 1))

echo "== (c) fidelity: $DEVICE bf16 vs the CPU fp32 golden file, and vs CPU bf16 (the device alone)"
for where in "$DEVICE" cpu; do
  timeout 150 "$PYTHON" -m trex train recipes/fidelity_default.toml --out "$OUT/fidelity-$where-bf16" \
    --set train.device=\""$where"\" --set precision.dtype=\"bf16\" > "$OUT/fidelity-$where-bf16.txt" 2>&1 \
    || failed=$((failed + 1))
done
"$PYTHON" -m trex fidelity compare "$OUT/fidelity-$DEVICE-bf16" fidelity/golden/default_cpu_fp32.json \
  --profile vendor 2>&1 | tee "$OUT/fidelity.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))
"$PYTHON" -m trex fidelity compare "$OUT/fidelity-$DEVICE-bf16" "$OUT/fidelity-cpu-bf16" \
  --profile vendor 2>&1 | tee "$OUT/fidelity-same-precision.txt"
[ "${PIPESTATUS[0]}" -eq 0 ] || failed=$((failed + 1))

"$PYTHON" bench/accelerator.py report "$OUT" --write > /dev/null && echo "figures written to docs/benchmarks.md"
echo "accelerator check: $failed part(s) failed"
exit "$failed"
