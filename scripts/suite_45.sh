#!/usr/bin/env bash
# Issue 14's measured run: the 45 problems of .shared/sol-execbench on one GPU, at one commit, in three device
# calls of this script (PART 1, 2, 3), each inside the device tool's 600 s per call, every problem with the same
# budget (8 candidates, 2 minutes, 2 workloads, 40 s per candidate: the settings of runs DU-DX). Then, here:
#   python3 scripts/suite_merge.py 1=<part 1>/suite_table.json 2=<part 2>/suite_table.json \
#     3=<part 3>/p1/suite_table.json 3=<part 3>/p2/suite_table.json
#
#   SHARDS sessions at once (default 8; parts a and b: 10). Run E2 (H100, 12 at once) lost champions to noisy final proofs that run DX
#   (at most 7 at a time) did not (BENCHMARKS.md, twenty-ninth session): on the H200, whose pool would hold 12 shares
#   of 11 GB, the run keeps to 8. MEM_GB is each shard's guard.memory_gb, by default the pool (the GPU's memory less
#   2 GB) over the shards: 17 GB on the H200, where an 11 GB share would leave 50 GB idle and, by the definitions'
#   sizes (a lower bound: no working memory), 12 problems without a workload and 12 with fewer seeds (7 and 7 at 17;
#   scripts/share_plan.py).
#   PART 1: 16 problems, a 460 s suite (SUITE_S)
#   PART 2: 16 others, the same
#   PART 3: L2/024 alone, its cap the GPU's memory less 2 GB (its guard needs about 100 GB for its two workloads
#           beside a champion: an H200; on an 80 GB card it ends with that reason), BIG_S seconds; then the last 12
#           (LIST3, LIST3_S seconds) with AGAIN="L1/094 L2/028" (problems parts 1 and 2 left stopped, as the merge's
#           table names them) queued after them
#   The lists balance the three calls on 8 shards by the sessions' minutes in runs DX and E2 (the larger, a stopped
#   one counted 3 minutes longer; about 8 minutes each, part 3 with L2/024's), and each is queued longest first, so
#   that the slow sessions start at once and the short ones fill the shards' ends.
#
# Two calls instead of three (a session whose device time holds one start and two full calls, about 1,300 s):
#   PART a: LIST1 and LIST3 interleaved (28 problems), a SUITE_S suite (default 470)
#   PART b: L2/024 alone (BIG_S, default 170), then LIST2 (16) with AGAIN after them (LIST2_S, default 290)
#   with SHARDS=10 (13 GB shares on the H200): 10 x 760 s of suite holds the 44 problems' ~115 session-minutes
#   (2.5 minutes a session on average in run G1), where 8 shards would leave about a fifth stopped.
#   Merge: python3 scripts/suite_merge.py a=<a>/suite_table.json b=<b>/p1/suite_table.json b=<b>/p2/suite_table.json
#   Then, on the same warm machine, the rows the merge names stopped or missing, as part 1 with the same budget (the
#   thirty-third session's I3 and I4: 14 of 45 on the H200):
#     SHARDS=12 SUITE_S=420 ONLY="<those problems>" bash scripts/suite_45.sh 1
#
# On the device (repo root; wheels in .whl and .whl/solx, the problems and the harness in .shared; OUT set by the
# device tool): bash scripts/suite_45.sh PART. The run's call: timeout_s 590, carry [".whl", ".shared"].
set -uo pipefail
PART=${1:?usage: bash scripts/suite_45.sh 1|2|3|a|b}
OUT=${OUT:-/tmp/kernelarc-out}
export OUT
SUITE_S=${SUITE_S:-460}  # parts 1 and 2: the suite's seconds (the call's limit less the install and the harness-free tail)
# parts a and b: 10 shards (run I2 of the thirty-third session ran part b on this default of 8, its call having left
# SHARDS out); parts 1-3: 8
case $PART in a | b) SHARDS=${SHARDS:-10} ;; esac
SHARDS=${SHARDS:-8}
TREE=.shared/sol-execbench
# ONLY="L1/094 L2/004 ...": part 1 or 2 runs these instead of its list (an A/B on a list of one's own);
# EXTRA="guard.bench_lock_s=20 ...": overrides added to every session of the call
read -r -a EXTRA <<<"${EXTRA:-}"
BUDGET=(suite.workloads=2 budget.candidates=8 budget.minutes=2 guard.target_ms=50 executor.parallel=2
  search.calibrate=false guard.timeout_s=40 guard.baseline_timeout_s=300 guard.compile_timeout_s=60)
LIST1="L2/028 L1/094 L2/057 L1/089 L2/043 L2/041 Quant/003 Quant/004 L1/034 L2/004 L2/008 FlashInfer-Bench/024
  L1/008 L2/006 L1/054 L2/015"
LIST2="L2/001 L1/087 L2/069 L2/017 L2/049 L2/055 L1/002 L1/001 Quant/021 L1/043 L1/045 Quant/015 L1/011 L1/058
  Quant/014 L1/006"
LIST3="L1/072 L2/059 L1/021 L2/030 L1/085 L1/003 Quant/001 L1/013 FlashInfer-Bench/010 L1/061 FlashInfer-Bench/001
  FlashInfer-Bench/004"

# "L1/094 L2/004" -> the problems' folders under the tree, in that order (a name that matches nothing fails the call)
folders() {
  local p d out=""
  for p in $1; do
    d=$(cd "$TREE" && ls -d "${p}"_* 2>/dev/null | head -1)
    [ -n "$d" ] || { echo "no problem $p under $TREE" >&2; return 1; }
    out+="$d "
  done
  echo "${out% }"
}

timeout 100 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  .whl/*.whl || exit 1
timeout 50 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/solx \
  .whl/solx/*.whl || exit 1
gpu_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1 | awk '{print int($1 / 1024)}')
[ -n "$gpu_gb" ] || { echo "no GPU (nvidia-smi)" >&2; exit 2; }
MEM_GB=${MEM_GB:-$(( (gpu_gb - 2) / SHARDS ))}
echo "== $SHARDS shards of guard.memory_gb=$MEM_GB on a $gpu_gb GB GPU"
suite() {  # OUT SHARDS SUITE_S OUTER_S PROBLEMS overrides...
  local out=$1 shards=$2 suite_s=$3 outer_s=$4 probs=$5
  shift 5
  OUT=$out SKIP_INSTALL=1 QUIET_CPUS=2 PROBLEMS="$probs" SHARDS=$shards \
    timeout "$outer_s" bash scripts/gpu_suite.sh "$TREE" "$suite_s" 0 "${BUDGET[@]}" "$@" 2>&1 | tail -60
}
# L2/024 alone with the card's memory (BIG seconds) into $OUT/p1, then LIST (REST seconds) on the shards into $OUT/p2
alone_then() {  # BIG LIST REST
  local P
  P=$(folders "L2/024") || return 2
  echo "== L2/024 alone, guard.memory_gb=$((gpu_gb - 2))"
  suite "$OUT/p1" 1 "$1" $(($1 + 30)) "$P" "guard.memory_gb=$((gpu_gb - 2))" "${EXTRA[@]}"
  P=$(folders "$2") || return 2
  echo "== the last $(wc -w <<<"$P"): $P"
  suite "$OUT/p2" "$SHARDS" "$3" $(($3 + 35)) "$P" "guard.memory_gb=$MEM_GB" "${EXTRA[@]}"
}
case $PART in
  1 | 2)
    [ "$PART" = 1 ] && L=$LIST1 || L=$LIST2
    P=$(folders "${ONLY:-$L}") || exit 2
    suite "$OUT" "$SHARDS" "$SUITE_S" $((SUITE_S + 70)) "$P" "guard.memory_gb=$MEM_GB" "${EXTRA[@]}"
    ;;
  3) alone_then "${BIG_S:-220}" "$LIST3 ${AGAIN:-}" "${LIST3_S:-270}" || exit 2 ;;
  a)
    P=$(folders "$(paste -d' ' <(tr -s ' \n' '\n' <<<"$LIST1" | grep .) <(tr -s ' \n' '\n' <<<"$LIST3" | grep .) | tr '\n' ' ')") \
      || exit 2
    suite "$OUT" "$SHARDS" "${SUITE_S_A:-470}" $(( ${SUITE_S_A:-470} + 60 )) "$P" "guard.memory_gb=$MEM_GB" "${EXTRA[@]}"
    ;;
  b) alone_then "${BIG_S:-170}" "$LIST2 ${AGAIN:-}" "${LIST2_S:-290}" || exit 2 ;;
  *) echo "PART is 1, 2, 3, a or b" >&2; exit 2 ;;
esac
