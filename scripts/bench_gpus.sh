#!/usr/bin/env bash
# One scripts/bench.py per GPU, side by side: a machine with N GPUs runs N task groups at once.
#   scripts/bench_gpus.sh OUT LIMIT_S "ARGS for GPU 0" ["ARGS for GPU 1" ...]
# Each group sees only its own GPU (CUDA_VISIBLE_DEVICES), has its own state and MLflow store,
# writes OUT/gpuI/{bench.json,bench.md,log.txt} and is stopped after LIMIT_S (SIGKILL 15 s later).
# The last lines printed are each group's table.
set -u
set -f  # ARGS are split on spaces only: a sweep grid's [..] is no filename pattern
out=$1 limit=$2
shift 2
mkdir -p "$out"
i=0
for args in "$@"; do
  mkdir -p "$out/gpu$i"
  # shellcheck disable=SC2086 # ARGS is a list of options
  CUDA_VISIBLE_DEVICES=$i timeout -k 15 "$limit" python3 scripts/bench.py $args \
    --out "$out/gpu$i" --state "/tmp/kernelarc-bench/gpu$i" >"$out/gpu$i/log.txt" 2>&1 &
  echo "gpu $i: scripts/bench.py $args (pid $!)"
  i=$((i + 1))
done
while [ -n "$(jobs -r)" ]; do
  sleep 30
  for d in "$out"/gpu*; do echo "[$(date -u +%T)] $(basename "$d"): $(grep -v '✓ slower' "$d/log.txt" | tail -1 | cut -c1-150)"; done
done
wait
for d in "$out"/gpu*; do
  echo "=== $(basename "$d")"
  if [ -f "$d/bench.md" ]; then cat "$d/bench.md"; else grep -v '✓ slower' "$d/log.txt" | tail -40; fi
done
