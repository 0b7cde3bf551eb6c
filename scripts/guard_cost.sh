#!/usr/bin/env bash
# The guard's time per candidate before round 2 (commit 8ddc22d) and now (issue 15), by scripts/guard_cost.py.
#   scripts/guard_cost.sh prepare [COMMIT]   here: the before-tree into the ignored folder .before/ (travels
#                                            to the device with carry [".before", ".shared"])
#   scripts/guard_cost.sh run [OUTDIR] [ARGS...]
#                                            both trees one after the other (each under `timeout`), then the
#                                            comparison; ARGS go to both (e.g. --repeats 1). On an H200 about 90 s.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-run}" in
prepare)
    commit=${2:-8ddc22d}
    rm -rf .before
    mkdir .before
    git archive "$commit" | tar x -C .before
    git rev-parse --short "$commit" >.before/.commit
    git describe --always --dirty >.before/.after_commit  # the after-tree's label (the device may lack .git)
    git check-ignore -q .before || echo "/.before/" >>"$(git rev-parse --git-common-dir)/info/exclude"
    git check-ignore -q .before && echo ".before/ holds $commit (ignored, carry it)"
    ;;
run)
    out=${2:-${OUT:-/tmp/guard_cost}}
    shift $(($# < 2 ? $# : 2))
    # default: one PyTorch and one Triton candidate, twice each, per task (fits about 90 s on an H200)
    [ $# -gt 0 ] || set -- --candidates torch_rsqrt,triton_row --repeats 2
    mkdir -p "$out"
    [ -f .before/kernelarc/guard/judge.py ] || { echo "no .before/: run 'scripts/guard_cost.sh prepare' first" >&2; exit 2; }
    budget=${GUARD_COST_BUDGET_S:-30}  # seconds per tree in which candidates start; the timeout is the hard stop
    hard=${GUARD_COST_TIMEOUT_S:-45}
    PYTHONPATH=$PWD/.before:${GUARD_COST_SITE:-/tmp/site} timeout -k 5 "$hard" python3 scripts/guard_cost.py --tree .before \
        --out "$out/before.json" --budget-s "$budget" "$@" 2>"$out/before.log" || echo "before-tree: exit $?"
    PYTHONPATH=$PWD:${GUARD_COST_SITE:-/tmp/site} timeout -k 5 "$hard" python3 scripts/guard_cost.py --tree . --commit "$(cat .before/.after_commit)" \
        --out "$out/after.json" --budget-s "$budget" "$@" 2>"$out/after.log" || echo "after-tree: exit $?"
    python3 scripts/guard_cost.py --compare "$out/before.json" "$out/after.json"
    ;;
*)
    echo "usage: $0 prepare [COMMIT] | run [OUTDIR] [ARGS...]" >&2
    exit 2
    ;;
esac
