#!/usr/bin/env bash
# The accelerator check: one prepared script, under 9 minutes on one CUDA or Ascend device, its parts in
# order of what a short loan must not miss, each with its own time limit inside one overall budget:
#   (0) the wheels it needs installed offline from bench/device-wheels (`make device-wheels` here, then carry
#       bench/device-wheels with the tree; the device's own torch is kept);
#   (1) the V4-Flash-shaped training step (bench/accelerator.py step), eager, bf16, S = 4096, with MFU;
#   (2) `trex profile` of the same step on the device, eager: the step by class, measured, beside the
#       roofline estimate of the same ops on the device's hardware profile (how far estimate and device are);
#   (3) fidelity: recipes/fidelity_default.toml in bf16 on the device, eager, against CPU bf16 (prepared here:
#       `make device-reference`, carried as runs/accelerator-ref), profile vendor, the same switches pinned
#       (train.compile off, Muon's iterations in fp32 on both sides);
#   (4) the device's own tests (the kernels' equivalence tests with TREX_DEVICE set) and FlexAttention's backward;
#   (5) trex's DeepSeek-V3 beside torchtitan 0.3.0's on the device (bench/peer_step.py);
#   (6) the compiled step, and (7) the compiled fidelity run, with whatever time is left;
# then every figure goes into docs/benchmarks.md (bench/accelerator.py report) and $OUT/parts.json says what
# each part did and how long it took.
#
#   bash bench/accelerator.sh                          # the device torch.accelerator finds
#   TREX_DEVICE=npu OUT=/tmp/acc bash bench/accelerator.sh
#   BUDGET=300 SMOKE=1 TREX_DEVICE=cpu bash bench/accelerator.sh   # the script itself, on the CPU, tiny sizes
#
# The exit status is the number of parts that failed (a part skipped for lack of time is not a failure; it
# is listed in parts.json).
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
OUT=${OUT:-runs/accelerator}
BUDGET=${BUDGET:-510}   # seconds for every part together (9 minutes less the start and the report)
SMOKE=${SMOKE:-}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHON OUT SMOKE
start=$SECONDS
failed=0
parts=()

# part NAME CAP_SECONDS COMMAND...: run COMMAND under min(CAP, the budget left); record its status and time
part() {
  local name=$1 cap=$2 left t0 rc status
  shift 2
  left=$(( BUDGET - (SECONDS - start) ))
  [ "$left" -lt "$cap" ] && cap=$left
  if [ "$cap" -lt 15 ]; then
    echo "== $name: skipped, $left s of the budget left"
    parts+=("{\"part\": \"$name\", \"status\": \"skipped\", \"seconds\": 0}")
    return
  fi
  echo "== $name (at most $cap s)"
  t0=$SECONDS
  timeout "$cap" bash -c '"$@"' "$name" "$@"  # in a shell of its own: the functions below are exported
  rc=$?
  status=ok
  if [ "$rc" -eq 124 ]; then status=timeout; elif [ "$rc" -ne 0 ]; then status="failed ($rc)"; fi
  [ "$status" = ok ] || failed=$((failed + 1))
  parts+=("{\"part\": \"$name\", \"status\": \"$status\", \"seconds\": $((SECONDS - t0)), \"limit\": $cap}")
}

install() {
  if [ -d bench/device-wheels ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --find-links bench/device-wheels \
      -r bench/device-requirements.txt || return 1
  fi
  "$PYTHON" -c "import trex" 2>/dev/null || "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . || return 1
}
export -f install
part install 60 install
DEVICE=${TREX_DEVICE:-$("$PYTHON" -c "from trex import device; print(device.detect().type)")}
echo "accelerator check on device type $DEVICE, outputs in $OUT, budget $BUDGET s"
"$PYTHON" -m trex doctor --format json > "$OUT/env.json" 2>/dev/null || echo '{}' > "$OUT/env.json"
export DEVICE
step() {  # step FORM: the V4-Flash-shaped step (SMOKE: the tiny preset, no code generation)
  local args=(--device "$DEVICE" --dtype bf16)
  [ -n "$SMOKE" ] && args+=(--smoke --backend eager --seq 256)
  "$PYTHON" bench/accelerator.py step "${args[@]}" --forms "$1" --out "$OUT/step-$1.json"
}
export -f step

part "step, eager" 120 step eager

profile() {  # trex profile of the step, eager, on the device; then the table against its own estimate
  local recipe=recipes/v4_flash_4layer_step.toml sets=()
  [ -n "$SMOKE" ] && recipe=recipes/fidelity_default.toml sets=(--set data.micro_batch_size=1)
  "$PYTHON" -m trex --device "$DEVICE" profile "$recipe" "${sets[@]}" --set train.compile=false \
    --out "$OUT/profile" --steps 2 --warmup 1 --format json > "$OUT/profile.json" || return 1
  "$PYTHON" bench/accelerator.py profile-table "$OUT/profile.json" | tee "$OUT/profile.txt"
}
export -f profile
part "profile, eager" 150 profile

fidelity() {  # fidelity RUN_NAME EXTRA_SETS...: the device run, then compare with CPU bf16 under the same pins
  local name=$1 ref=runs/accelerator-ref/fidelity-cpu-bf16
  local pins=(--set 'precision.dtype="bf16"' --set train.compile=false --set 'optim.ns_dtype="fp32"')  # = Makefile's
  shift
  "$PYTHON" -m trex train recipes/fidelity_default.toml --out "$OUT/$name" --set train.device=\""$DEVICE"\" \
    "${pins[@]}" "$@" > "$OUT/$name.log" 2>&1 || return 1
  if [ ! -f "$ref/summary.json" ]; then  # not prepared here (make device-reference): the device host's CPU makes it
    ref="$OUT/fidelity-cpu-bf16"
    [ -f "$ref/summary.json" ] || "$PYTHON" -m trex train recipes/fidelity_default.toml --out "$ref" \
      --set 'train.device="cpu"' "${pins[@]}" > "$ref.log" 2>&1 || return 1
  fi
  "$PYTHON" -m trex fidelity compare "$OUT/$name" "$ref" --profile vendor > "$OUT/$name.txt" 2>&1
  local rc=$?
  cat "$OUT/$name.txt"
  return $rc
}
export -f fidelity
part "fidelity, eager" 120 fidelity fidelity-eager

device_tests() {
  TREX_DEVICE=$DEVICE "$PYTHON" -m pytest -q -p no:cacheprovider -p no:xdist tests/test_fp32_matmul.py \
    tests/test_kernels.py tests/test_dense_attention.py tests/test_device.py 2>&1 | tee "$OUT/tests.txt"
  [ "${PIPESTATUS[0]}" -eq 0 ] || return 1
  [ "$DEVICE" = cpu ] && return 0  # FlexAttention has no CPU backward
  "$PYTHON" -m trex.kernels.flex_attention "$DEVICE" 2>&1 | tee "$OUT/flex.txt"
  return "${PIPESTATUS[0]}"
}
export -f device_tests
part "device tests" 90 device_tests

if "$PYTHON" -c "import torchtitan" 2>/dev/null && [ -f bench/peer_step.py ]; then
  peer() {
    local args=(--device "$DEVICE" --out "$OUT/peer.json" --check-attention sdpa)
    [ -n "$SMOKE" ] && args+=(--seqs 128 --steps 2)
    "$PYTHON" bench/peer_step.py "${args[@]}"
  }
  export -f peer
  part "peer: torchtitan" 150 peer
else
  parts+=("{\"part\": \"peer: torchtitan\", \"status\": \"skipped: torchtitan not installed\", \"seconds\": 0}")
fi

part "step, compiled" 260 step compiled
part "fidelity, compiled" 200 fidelity fidelity-compiled --set train.compile=true

(IFS=,; echo "[${parts[*]}]") > "$OUT/parts.json"
if [ -n "$SMOKE" ]; then  # the script's own check: print, never replace a device's figures
  "$PYTHON" bench/accelerator.py report "$OUT" > "$OUT/report.md" && echo "report: $OUT/report.md"
else
  "$PYTHON" bench/accelerator.py report "$OUT" --write > /dev/null && echo "figures written to docs/benchmarks.md"
  [ -f "$OUT/peer.json" ] && "$PYTHON" bench/peer_step.py --report "$OUT/peer.json" --write > /dev/null
fi
echo "accelerator check: $failed part(s) failed, $((SECONDS - start)) s"
exit "$failed"
