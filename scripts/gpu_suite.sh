#!/usr/bin/env bash
# One device call: the suite over a tree of SOL-ExecBench problems on one GPU, as SHARDS concurrent
# suite processes sharing one queue of problems (compilation and torch.compile spread over the CPU
# cores; the guard's DeviceLock serialises every checked or timed phase across the processes, so no
# two timings overlap), then
# NVIDIA's harness on the exported champions. The state (.kernelarc, mlflow.db, mlartifacts) is
# tarred into $OUT/state.tgz; put it at .state/state.tgz and carry .state to resume in a later call.
#
# Usage, on the device machine (repo root, wheels carried in .whl and .whl/solx, problems and the
# harness copied into the ignored folder .shared):
#   SHARDS=8 bash scripts/gpu_suite.sh .shared/sol-execbench SUITE_SECONDS HARNESS_SECONDS [overrides...]
# (HARNESS_PAR=4 harness runs at a time, HARNESS_CALL_S=90 s per harness call; PROBLEMS="a b" for a subset;
#  ORDER="L2 Quant" to queue those groups first; HARNESS_SECONDS=0 skips the harness; QUIET_CPUS=2 reserves two
#  CPUs for the measured workers, see below)
set -uo pipefail
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0
TREE=$(realpath "$1"); SUITE_S=$2; HARNESS_S=$3; shift 3
SHARDS=${SHARDS:-8}
OUT=${OUT:-/tmp/kernelarc-out}
HARNESS_SRC=${HARNESS_SRC:-$PWD/.shared/sol-execbench-harness/src}
mkdir -p "$OUT/logs"
t0=$(date +%s)
say() { echo "[$(( $(date +%s) - t0 ))s] $*"; }

[ -n "${SKIP_INSTALL:-}" ] || timeout 120 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
[ -n "${SKIP_INSTALL:-}" ] || timeout 60 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/solx .whl/solx/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
# One MLflow store per shard, on the machine's own disk: SQLite's WAL shared memory does not hold across
# processes on the device machine's copy of the checkout (10 shards on one mlflow.db there: "database disk
# image is malformed"), and one store per process never needs it.
STORES=/tmp/kernelarc-stores
mkdir -p "$STORES"
if [ -f .state/state.tgz ]; then tar xzf .state/state.tgz -C / && say "restored state of an earlier call"
elif ls -d .kernelarc/suite_shard* >/dev/null 2>&1; then
  # a warm machine keeps the checkout's ignored folders but not /tmp's stores: sessions cut by an earlier
  # call would resume with their budget partly spent; set them aside (kept) so every problem starts fresh
  stale=.kernelarc.stale-$(date +%s); mv .kernelarc "$stale" && say "an earlier call's .kernelarc moved to $stale"
fi
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader
# the device's copy of the checkout carries the working tree's files but not always its git metadata (run 19 printed
# the session's first commit): the hash of kernelarc/'s sources says which tree ran; the same command on a checkout
# of a commit gives that commit's. LC_ALL=C: the device's locale collates without punctuation, and its hash differed
# from the same command's here (E1/E2: 8ce028614ac6 on the device, 6d6ac8ffa008 here, both commit 44dff96)
src_hash=$(cd kernelarc && find . -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12)
say "installed; commit $(git rev-parse --short HEAD 2>/dev/null || echo '?') (git metadata of the copy); kernelarc sources $src_hash"

if [ -n "${PROBLEMS:-}" ]; then read -r -a PROBS <<<"$PROBLEMS"  # a chosen subset, in this order
else mapfile -t PROBS < <(cd "$TREE" && find . -name definition.json -printf '%h\n' | sed 's|^\./||' | sort); fi
# ORDER="L2 Quant": those groups' problems first, in that order (heavy sessions first keep the shards busy to the end)
if [ -n "${ORDER:-}" ]; then
  mapfile -t PROBS < <(printf '%s\n' "${PROBS[@]}" | awk -v order="$ORDER" \
    'BEGIN { n = split(order, o, " "); for (i = 1; i <= n; i++) rank[o[i]] = i }
     { g = $0; sub(/\/.*/, "", g); r = (g in rank) ? rank[g] : n + 1; printf "%d\t%s\n", r, $0 }' | sort -s -k1,1n | cut -f2)
fi
say "${#PROBS[@]} problems, $SHARDS shards, suite ${SUITE_S}s, overrides: $*"
# the shards share the GPU's memory: each session's guard plans up to guard.memory_gb for itself (sixth session,
# 7 shards x 40 GB on a 141 GB H200: 5 candidates of one L2/004 session in run U and L2/015's torch.compile in run S
# died of "CUDA out of memory" while other shards held theirs)
mem_gb=$(printf '%s\n' "$@" | sed -n 's/^guard\.memory_gb=//p' | tail -1)
gpu_gb=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1 | awk '{print int($1 / 1024)}')
if [ -n "$mem_gb" ] && [ -n "$gpu_gb" ] && awk -v m="$mem_gb" -v s="$SHARDS" -v g="$gpu_gb" 'BEGIN { exit !(m * s > g) }'; then
  say "warning: $SHARDS shards x guard.memory_gb=$mem_gb exceed the GPU's $gpu_gb GB: shards wait for each other's memory (the pool below; about $(( gpu_gb / SHARDS )) GB per shard runs them all at once)"
fi
# With guard.memory_gb given, the shards share the GPU's memory as one pool (suite.memory_pool_gb, kernelarc/memory_pool.py):
# a problem whose guard needs more than the share for one input set (L2/004: 24 GB, L2/024: 47 GB against 17 GB
# in runs W/X) runs again right away with the cap it needs, once the other shards have freed
# that much (they start nothing new while it waits). POOL_GB overrides the pool (default: the GPU's GB less 2).
POOL=()
if [ -n "$mem_gb" ] && [ -n "$gpu_gb" ] && ! printf '%s\n' "$@" | grep -q '^suite\.memory_pool_gb='; then
  POOL=("suite.memory_pool_gb=${POOL_GB:-$(awk -v g="$gpu_gb" -v m="$mem_gb" 'BEGIN { p = g - 2; print (p > m ? p : m) }')}")
  say "memory pool ${POOL[0]#*=} GB over the shards, ${mem_gb} GB each"
fi
# Every shard gets the whole list and takes problems from one queue (suite.claims): a shard that drew
# quick problems goes on with the next one instead of idling while another works through slow ones.
CLAIMS=/tmp/kernelarc-claims; rm -rf "$CLAIMS"; mkdir -p "$CLAIMS"
# after a restore, problems with a saved row in any shard are taken already (not a crash, nor a row saved when a
# stop cut its session: those run again, from their session state)
python3 - "$CLAIMS" <<'EOF2'
import json, pathlib, sys
for r in pathlib.Path(".kernelarc").glob("suite_shard*/*/*/results/*.json"):
    row = json.loads(r.read_text())
    if row.get("status") != "crashed" and not row.get("stopped"):
        (pathlib.Path(sys.argv[1]) / (r.stem + ".claim")).write_text("restored\n")
EOF2
list=""; for p in "${PROBS[@]}"; do list+="'$p',"; done
# the library store is read from a copy on the machine's own disk (SQLite's WAL across processes does not
# hold on the device machine's copy of the checkout)
LIBDB=/tmp/kernelarc-library.db
if [ -n "${LIBRARY:-}" ]; then cp "$LIBRARY" "$LIBDB" && say "kernel library: $LIBRARY"; fi
# QUIET_CPUS=N: the first N CPUs are reserved for the workers being measured (kernelarc/guard/quiet.py): every
# shard runs on the others, and a guard moves the workers it checks and times onto the reserved ones while it
# holds the device lock (only one guard holds it at a time), so compiling shards no longer deschedule a timed
# launch-bound call's host side. Default 0: off (not yet measured on the H200).
PIN=()
if [ "${QUIET_CPUS:-0}" -gt 0 ] && command -v taskset >/dev/null; then
  # the CPUs this process may use (not always 0..nproc-1): the first QUIET_CPUS quiet, the rest for the shards
  read -r QUIET REST < <(python3 -c 'import os, sys; c = sorted(os.sched_getaffinity(0)); n = int(sys.argv[1])
print(",".join(map(str, c[:n])), ",".join(map(str, c[n:])) if len(c) > n + 1 else "")' "$QUIET_CPUS")
  if [ -n "${REST:-}" ]; then
    export KERNELARC_QUIET_CPUS=$QUIET
    PIN=(taskset -c "$REST")
    say "quiet CPUs $QUIET for measured workers; shards on CPUs $REST"
  else
    say "warning: QUIET_CPUS=$QUIET_CPUS leaves fewer than two CPUs for the shards; quiet cores off"
  fi
fi
# The rows so far into $OUT/suite_table.json: every shard's table.json, and the result file of each problem whose
# shard was killed before writing its table (run DW: an outer timeout cut this script 30 s after its suite, so no
# table came back). Also on SIGTERM, so a call cut short still returns the rows its shards saved.
collect_rows() {
  # finished over stopped over crashed, a later row over an earlier one of its rank (an earlier call's crash restored
  # beside this call's row): suite_merge.py's rule, without torch
  python3 "$(dirname "$0")/suite_merge.py" --collect "$OUT"
}
# A SIGTERM to this script (an outer timeout) stops the shards the same way (each `timeout` passes it on; the
# suite saves its running problem's row within its grace), waits for them a bounded while, and keeps what they
# saved: the rows and the logs, packed (a call returns a few files only: DW's twelve shard logs came back as
# eight). Nothing is resumable from such a call: state.tgz is written only at the end.
on_term() {
  say "stopped (SIGTERM): the shards are stopped, then the rows saved so far"
  [ ${#pids[@]} -gt 0 ] && kill -TERM "${pids[@]}" 2>/dev/null
  for _ in $(seq 15); do
    alive=0; for p in "${pids[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break; sleep 1
  done
  collect_rows
  [ -d "$OUT/logs" ] && tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
  exit 143
}
pids=()
trap on_term TERM
for ((k = 0; k < SHARDS; k++)); do
  # LIBRARY=path/to/mlflow.db: a store whose champions of the built-in tasks (e.g. from scripts/bench.py) start
  # the problems' sites (the kernel library); every shard reads it, none writes it. GPU: the target (default auto:
  # the card present; a call for an H200 can get an H100, and gpu=h200 then refuses to run, as run 18 did)
  timeout -k 10 "$SUITE_S" "${PIN[@]}" python3 -m kernelarc.suite dir="$TREE" "suite.problems=[${list%,}]" suite.claims="$CLAIMS" \
    ${LIBRARY:+search.library_uri=sqlite:///$LIBDB} \
    suite.out=.kernelarc/suite_shard$k gpu=${GPU:-auto} tracking.uri=sqlite:///$STORES/shard$k/mlflow.db "${POOL[@]}" "$@" \
    >"$OUT/logs/shard$k.log" 2>&1 &
  pids+=($!)
  sleep 2  # staggered starts: ten imports of torch at once only slow each other
done
for p in "${pids[@]}"; do wait "$p"; done
say "suite shards done"
collect_rows

PROBLIST="${PROBS[*]}" python3 - "$OUT" <<'EOF'
import json, os, pathlib, sys
out = pathlib.Path(sys.argv[1])
rows = json.loads((out / "suite_table.json").read_text())
by = {}
for r in rows:
    by[r["status"]] = by.get(r["status"], 0) + 1
print("suite rows:", len(rows), by)
from kernelarc.suite import ProblemResult, render_table  # its closing lines: built champions, geomean, timing
for line in render_table([ProblemResult.model_validate(r) for r in rows]).splitlines():
    if line.startswith(("a KernelArc-built", "timing:")):
        print(line)
missing = sorted(set(os.environ.get("PROBLIST", "").split()) - {r["problem"] for r in rows})
print(f"problems without a row ({len(missing)}):", " ".join(missing) or "none")
for r in rows:
    f = lambda k, s=".2f": format(r[k], s) if isinstance(r.get(k), (int, float)) else "-"
    print(f"{r['problem'][:58]:58s} {r['status']:9s} {str(r.get('champion_family'))[:28]:28s} "
          f"ref {f('speedup_vs_reference')} tc {f('speedup_vs_compile')} dc {f('speedup_vs_compile_drift_corrected')} "
          f"n={r.get('evaluated')} "
          f"{(r.get('reason') or '')[:60]}")
EOF

# NVIDIA's harness on every shard's champions, HARNESS_PAR shards at a time (searched kernels first,
# then the problems whose champion is a baseline). Concurrent harness runs share the GPU: their
# verdicts stand, their speedups are noisier than a lone run's.
HARNESS_PAR=${HARNESS_PAR:-4}
hdeadline=$(( $(date +%s) + HARNESS_S ))
harness_shard() {
  local s=$1 k; k=$(basename "$(dirname "$(dirname "$s")")"); k=${k#suite_}
  for pass in "" "--all"; do
    local left=$(( hdeadline - $(date +%s) )); [ "$left" -le 15 ] && return
    timeout -k 5 "$left" python3 scripts/harness_eval.py --suite "$s" --harness-src "$HARNESS_SRC" \
      --harness-path /tmp/solx --timeout "${HARNESS_CALL_S:-90}" --tracking-uri "sqlite:///$STORES/$k/mlflow.db" $pass \
      >>"$OUT/logs/harness_$k.log" 2>&1
  done
}
export -f harness_shard; export hdeadline HARNESS_SRC STORES OUT
ls -d .kernelarc/suite_shard*/*/*/ | while read -r s; do [ -f "$s/table.json" ] && echo "$s"; done |
  xargs -P "$HARNESS_PAR" -I{} bash -c 'harness_shard "$1"' _ {}
say "harness done"
collect_rows  # again: the harness wrote its verdicts into the tables
python3 - "$OUT" <<'EOF'
import json, pathlib, sys
rows = json.loads(pathlib.Path(sys.argv[1], "suite_table.json").read_text())
ev = [r for r in rows if r.get("harness_verdict")]
print(f"harness evaluated {len(ev)}:")
for r in ev:
    print(f"  {r['problem'][:60]:60s} {r['harness_verdict']:10s} {r.get('harness_passed')} x{r.get('harness_speedup')}")
EOF
# what each session judged, small enough to come back when state.tgz does not (over the 16 MiB limit)
python3 - "$OUT" <<'EOF3'
import json, pathlib, sys
out = {}
# an error's head and its tail: a Triton CompilationError names the failing line at the end (run DN: L1/002's
# group_norm point under Inductor kept only "at 16:17: ..." and the kernel's first lines)
cut = lambda e: e if len(e) <= 1000 else e[:300] + " [...] " + e[-700:]
for f in sorted(pathlib.Path(".kernelarc").glob("*/*/*/evaluations.jsonl")):
    recs = [json.loads(x) for x in f.read_text().splitlines() if x.strip()]
    crowned = [r for r in recs if r["verdict"]["status"] == "champion" and r["kind"] != "final"]
    brief = lambda r: {"kind": r["kind"], "family": r["candidate"].get("family") or r["candidate"].get("strategy"),
                       "knobs": r["candidate"].get("knobs"), "status": r["verdict"]["status"],
                       "ms": r["verdict"].get("latency_ms"), "error": cut((r["verdict"].get("errors") or [""])[0]),
                       "vs_champion": r["verdict"].get("speedup_vs_champion"),
                       "warning": next((w[:200] for w in r["verdict"].get("warnings") or [] if "inconsistent" in w), ""),
                       "warnings": [w[:200] for w in (r["verdict"].get("warnings") or [])[:6]],
                       "wl": [(w.get("latency_ms"), w.get("champion_ms")) for w in r["verdict"].get("workloads") or []]}
    out[str(f.parent)] = {"champion": brief(crowned[-1]) if crowned else None, "judged": [brief(r) for r in recs]}
pathlib.Path(sys.argv[1], "sessions.json").write_text(json.dumps(out, indent=1, default=str))
print(f"sessions.json: {len(out)} sessions")
EOF3
trap - TERM
tar czf "$OUT/state.tgz" -P "$PWD/.kernelarc" "$STORES" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
say "end"
