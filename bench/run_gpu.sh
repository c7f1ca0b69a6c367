#!/usr/bin/env bash
# run_gpu.sh — everything that needs the GPU, in one command, on the device machine.
# Expects the programs packed by ../shared/tools/gpu-pack into .gpu/ (see docs/perf.md):
#   ninja -C build-e test_kernels kvbench_attn
#   ../shared/tools/gpu-pack build-e/tests/gpu/test_kernels build-e/tests/gpu/kvbench_attn
# then, through the device tool with carry [".gpu"]:  bash bench/run_gpu.sh
# Writes to $OUT (default ./gpu-out): test.log, memcheck.log, racecheck.log, bench.json,
# sdpa.json, nvidia-smi.txt. Exits non-zero when the tests or a sanitizer fail.
# Knobs: GPU_DIR (default .gpu), SANITIZERS (default "memcheck racecheck"), SKIP_SANITIZE=1,
# SKIP_BENCH=1, SDPA_JSON=file (reuse dense figures instead of running torch),
# KVBENCH_COLD_MB (default 256: the "ms_cold" figures; 0 turns them off).
set -uo pipefail
OUT=${OUT:-./gpu-out}
mkdir -p "$OUT"
GPU_DIR=${GPU_DIR:-.gpu} # where the packed programs are (another helper may own .gpu/)
export LD_LIBRARY_PATH=$PWD/$GPU_DIR/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
BIN=$PWD/$GPU_DIR/bin
rc=0
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.total --format=csv \
  >"$OUT/nvidia-smi.txt" 2>&1
echo "== test_kernels"
"$BIN/test_kernels" 2>&1 | tee "$OUT/test.log" | grep -E "FAIL|passed" || rc=1
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
if [ "${SKIP_SANITIZE:-0}" != 1 ]; then
  for tool in ${SANITIZERS:-memcheck racecheck}; do
    echo "== compute-sanitizer --tool $tool (test_kernels --small)"
    compute-sanitizer --tool "$tool" --error-exitcode 7 "$BIN/test_kernels" --small \
      >"$OUT/$tool.log" 2>&1
    s=$?
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed" "$OUT/$tool.log" | tail -3
    [ "$s" -eq 0 ] || { echo "$tool exit $s"; rc=1; }
  done
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  echo "== kvbench_attn"
  # ms_cold: each call also timed after a 256 MB read fills L2 (KVBENCH_COLD_MB, session 14)
  KVBENCH_COLD_MB=${KVBENCH_COLD_MB:-256} "$BIN/kvbench_attn" >"$OUT/bench.json" \
    2>"$OUT/bench.err" || { cat "$OUT/bench.err"; rc=1; }
  if [ -n "${SDPA_JSON:-}" ]; then # dense figures of an earlier run on the same machine type
    cp "$SDPA_JSON" "$OUT/sdpa.json"
  else
    echo "== torch sdpa"
    PYTHONUNBUFFERED=1 python3 bench/torch_sdpa.py >"$OUT/sdpa.json" 2>"$OUT/sdpa.err" ||
      { tail -5 "$OUT/sdpa.err"; rc=1; }
  fi
  python3 bench/summary.py "$OUT/bench.json" "$OUT/sdpa.json" || true
fi
exit $rc
