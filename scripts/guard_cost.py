#!/usr/bin/env python3
"""The guard's wall time per candidate, for one KernelArc tree (issue 15: "reported before and after").

Judges the same honest candidates on the same tasks with the guard of the tree given by ``--tree`` and
reports, per task, the judge's wall time of ``Guard.evaluate`` per candidate (median, quartiles, range) and
the medians of the phases the verdicts report. Only interfaces that the guard had before round 2 (commit
8ddc22d) and still has are used (``Guard``, ``evaluate``, ``set_baselines``, ``load_task``, the session's
``guard_config``), so one script measures both trees:

    git archive 8ddc22d | (mkdir -p .before && tar x -C .before)     # the before-tree, an ignored folder
    PYTHONPATH=.before python3 scripts/guard_cost.py --tree .before --out before.json
    PYTHONPATH=.       python3 scripts/guard_cost.py --tree .       --out after.json
    python3 scripts/guard_cost.py --compare before.json after.json  # after/before per task, 20% rule

``scripts/guard_cost.sh`` wraps these (prepare here, run on the device). The guard settings are the
session's defaults (conf/, through ``guard_config``), each candidate is judged against the task's reference
as champion (as ``python -m kernelarc.check`` does), the torch.compile baseline is left out (minutes of
compiling, the same in both trees). On the CPU the workloads are those moving at most ``--cpu-max-bytes``
(the same indices in both trees), on a GPU all of them unless ``--workloads`` says otherwise.
``--budget-s`` stops starting candidates once a task has used its share; the JSON is rewritten after
every candidate, so a run cut short by ``timeout`` still leaves its numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PROBLEM = "FlashInfer-Bench/024_rmsnorm_h2048"
TASKS = ("rmsnorm", "h2048")  # the built-in rmsnorm; the SOL-ExecBench problem PROBLEM

# Honest kernels of different styles; every one computes the reference's fp32 RMSNorm (eps 1e-6). The
# guard calls run() positionally, so the names need not be the task's input names.
CANDIDATES: dict[str, tuple[str, str]] = {
    "torch_rsqrt": (
        "pytorch",
        """import torch


def run(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
""",
    ),
    "torch_functional": (
        "pytorch",
        """import torch
import torch.nn.functional as F


def run(x, weight):
    return F.rms_norm(x.float(), (x.shape[-1],), weight.float(), eps=1e-6).to(x.dtype)
""",
    ),
    "triton_row": (
        "triton",
        """import torch
import triton
import triton.language as tl


@triton.jit
def _rmsnorm_row(x_ptr, w_ptr, y_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)  # TAG
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + 1e-6)
    tl.store(y_ptr + row * N + offs, (x * inv * w).to(y_ptr.dtype.element_ty), mask=m)


def run(x, weight):
    M, N = x.shape
    y = torch.empty_like(x)
    _rmsnorm_row[(M,)](x, weight, y, N, BLOCK=triton.next_power_of_2(N))
    return y
""",
    ),
}


def _use_tree(tree: Path) -> None:
    """Import kernelarc from ``tree`` (before anything imports it), in this process and in the guard's workers
    (the round-2 pool passes sys.path on as PYTHONPATH; the old one spawns through multiprocessing, which
    copies sys.path)."""
    sys.path.insert(0, str(tree))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(tree), *filter(None, [os.environ.get("PYTHONPATH")])])


def _find_problem(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    for base in (ROOT.parent / "shared", ROOT / ".shared"):
        p = base / "sol-execbench" / PROBLEM
        if p.is_dir():
            return p
    return None


def _guard_settings(tree: Path, task: Any, on_cpu: bool) -> Any:
    """The GuardConfig a session of ``tree`` would use (conf/ defaults through session.guard_config)."""
    from hydra import compose, initialize_config_dir

    from kernelarc.app import typed
    from kernelarc.config import register_configs

    try:  # the wiring module (after the loop refactor of issue 16)
        from kernelarc.wiring import guard_settings as guard_config
    except ImportError:  # older trees (8ddc22d): the session built the guard's settings
        from kernelarc.session import guard_config

    register_configs()
    with initialize_config_dir(config_dir=str((tree / "conf").resolve()), version_base=None):
        cfg = compose("config", overrides=["+task=rmsnorm"])
    return guard_config(typed(cfg), task, on_cpu)


def _commit_of(tree: Path) -> str | None:
    if (tree / ".commit").is_file():
        return (tree / ".commit").read_text().strip()
    import subprocess

    try:
        r = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    except OSError:
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def _stats(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    if len(xs) >= 2:
        q = statistics.quantiles(xs, n=4, method="inclusive")
        p25, p75 = q[0], q[2]
    else:
        p25 = p75 = xs[0]
    return {"n": len(xs), "median": statistics.median(xs), "p25": p25, "p75": p75, "min": xs[0], "max": xs[-1]}


def measure_task(label: str, task: Any, tree: Path, device: str, args: argparse.Namespace, out: dict) -> None:
    from kernelarc.guard.judge import Guard, reference_candidate
    from kernelarc.models import Candidate

    on_cpu = device == "cpu"
    gcfg = _guard_settings(tree, task, on_cpu)
    if args.workloads:
        wls = [int(i) for i in args.workloads.split(",")]
    elif on_cpu:
        wls = [i for i in range(len(task.workloads)) if task.io_bytes(i) <= args.cpu_max_bytes]
        wls = wls or [min(range(len(task.workloads)), key=task.io_bytes)]
    else:
        wls = list(range(len(task.workloads)))
    gcfg.workloads = wls
    rec: dict[str, Any] = {
        "task": task.name,
        "workloads": wls,
        "axes": [dict(task.workloads[i].axes) for i in wls],
        "evals": [],
    }
    out["tasks"][label] = rec
    t0 = time.monotonic()
    deadline = t0 + args.budget_s / max(len(args.tasks), 1)
    guard = Guard(task, None, device, gcfg, seed=0)
    try:
        ref = guard.evaluate(reference_candidate(task), trusted=True, timeout_s=gcfg.baseline_timeout_s)
        rec["setup_s"] = time.monotonic() - t0
        rec["reference_status"] = ref.verdict.status.value
        if not ref.verdict.correct:
            rec["error"] = f"reference {ref.verdict.status.value}: {ref.verdict.errors[:2]}"
            print(f"{label}: {rec['error']}", file=sys.stderr)
            return
        guard.set_baselines(ref, None)
        names = [n for n in CANDIDATES if n in args.candidates]
        if args.warmup and not out.get("warmed") and "triton_row" in names:
            # Once per tree, untimed: Triton's first use builds its driver module into a cache that the
            # next candidates (of this run or a session) find, so it is not a cost per candidate.
            t = time.monotonic()
            language, src = CANDIDATES["triton_row"]
            tag = f"guard_cost warm-up {os.getpid()} {time.time_ns()}"
            guard.evaluate(Candidate(source=src.replace("TAG", tag), language=language), reference_candidate(task))
            out["warmed"] = rec["warmup_s"] = time.monotonic() - t
        for rep in range(args.repeats):
            for name in names:
                if time.monotonic() > deadline:
                    rec["cut_by_budget"] = True
                    return
                language, src = CANDIDATES[name]
                # Every source is new, as each of a session's candidates is: a comment in the module, and one in the
                # Triton kernel's body, whose source is the key of Triton's compile cache (so each one compiles).
                tag = f"guard_cost {name} repeat {rep} {os.getpid()} {time.time_ns()}"
                cand = Candidate(source=src.replace("TAG", tag) + f"\n# {tag}\n", language=language)
                t = time.monotonic()
                v = guard.evaluate(cand, reference_candidate(task)).verdict
                wall = time.monotonic() - t
                rec["evals"].append(
                    {
                        "candidate": name,
                        "repeat": rep,
                        "wall_s": wall,
                        "eval_seconds": v.eval_seconds,
                        "status": v.status.value,
                        "phases": dict(v.phases),
                        "errors": [e.splitlines()[0][:200] for e in v.errors if e][:3],
                        # the judge's own notes on timing (a CUPTI fallback) and on the champion's worker
                        "notes": [w[:200] for w in v.warnings if w.startswith("timing:") or "champion" in w][:3],
                    }
                )
                print(f"{label} {name} #{rep}: {wall:.2f} s {v.status.value} {v.phases}", file=sys.stderr, flush=True)
                _write(args.out, out)
    finally:
        _judge_counters(guard, rec)
        guard.close()
        rec["task_s"] = time.monotonic() - t0
        _summarise(rec)
        _write(args.out, out)


def _judge_counters(guard: Any, rec: dict) -> None:
    """Where the after-tree's judge spent its time (trees without these counters: nothing): seconds per worker
    command over the task (``drive.PROFILE``: side.command) and the pool's worker starts and waits."""
    try:
        from kernelarc.guard import drive

        rec["commands_s"] = {k: round(v, 3) for k, v in sorted(drive.PROFILE.items())}
        drive.PROFILE.clear()
    except ImportError:
        pass
    stats = getattr(getattr(guard, "_pool", None), "stats", None)
    if stats is not None:
        rec["pool"] = {**vars(stats), "size": guard._pool.size}


def _summarise(rec: dict) -> None:
    evals = rec["evals"]
    if not evals:
        return
    rec["wall"] = _stats([e["wall_s"] for e in evals])
    # the first candidate also pays for the pool's first workers and the first imports: said apart
    rec["wall_after_first"] = _stats([e["wall_s"] for e in evals[1:]]) if len(evals) > 1 else rec["wall"]
    rec["by_candidate"] = _by_candidate(rec)
    keys = sorted({k for e in evals for k in e["phases"]})
    rec["phases"] = {k: statistics.median([e["phases"].get(k, 0.0) for e in evals]) for k in keys}
    # the judge's own time around the worker's phases: waiting for a started worker, references, comparisons
    rec["phases"]["outside_phases"] = statistics.median([e["wall_s"] - sum(e["phases"].values()) for e in evals])
    rec["statuses"] = sorted({e["status"] for e in evals})
    rec["not_accepted"] = [f"{e['candidate']}#{e['repeat']}: {e['status']}" for e in evals if e["status"] not in
                           ("champion", "correct_slower")]  # fmt: skip


def _write(path: str | None, out: dict) -> None:
    if path:
        tmp = Path(path + ".tmp")
        tmp.write_text(json.dumps(out, indent=2))
        tmp.replace(path)


def _table(out: dict) -> str:
    head = f"{'task':<12} {'n':>3} {'median s':>9} {'p25-p75 s':>13} {'min-max s':>13} {'setup s':>8}"
    lines = [f"guard cost, tree {out['tree']} ({out.get('commit') or '?'}), device {out['device']}",
             head + "  phases (median s)"]  # fmt: skip
    for label, rec in out["tasks"].items():
        if "wall" not in rec:
            lines.append(f"{label:<12} no candidate judged {rec.get('error', '')}")
            continue
        w = rec["wall"]
        ph = " ".join(f"{k}={v:.2f}" for k, v in rec["phases"].items())
        if "warmup_s" in rec:
            ph += f" (untimed Triton warm-up first: {rec['warmup_s']:.1f} s)"
        lines.append(
            f"{label:<12} {w['n']:>3} {w['median']:>9.2f} {w['p25']:>6.2f}-{w['p75']:<6.2f} "
            f"{w['min']:>6.2f}-{w['max']:<6.2f} {rec.get('setup_s', float('nan')):>8.2f}  {ph}"
        )
        per = ", ".join(f"{n} {st['median']:.2f}" for n, st in rec["by_candidate"].items())
        lines.append(f"{'':<12} median s per candidate: {per}")
        setups = [e["phases"]["champion_setup"] for e in rec["evals"] if "champion_setup" in e["phases"]]
        if "pool" in rec:
            p = rec["pool"]
            lines.append(f"{'':<12} pool of {p['size']}: {p['starts']} worker starts, {p['waits']} of {p['acquired']} "
                         f"acquisitions waited ({p['wait_s']:.2f} s); champion worker set up in {len(setups)} "
                         f"timed evaluation(s) {' '.join(f'{x:.2f}' for x in setups)} s")  # fmt: skip
        notes = sorted({n for e in rec["evals"] for n in e.get("notes", [])})
        if notes:
            lines.append(f"{'':<12} judge notes: {' | '.join(notes)[:400]}")
        if rec.get("not_accepted"):
            lines.append(f"{'':<12} honest candidates not accepted: {', '.join(rec['not_accepted'])}")
    return "\n".join(lines)


def compare(before: Path, after: Path, limit: float) -> int:
    missing = [str(p) for p in (before, after) if not p.is_file()]
    if missing:
        print(f"nothing to compare: {', '.join(missing)} missing (see the .log beside it)")
        return 1
    b, a = json.loads(before.read_text()), json.loads(after.read_text())
    print(f"after ({a['tree']}) / before ({b['tree']}), device {a['device']} / {b['device']}")
    worst = 0.0
    for label in a["tasks"]:
        pa, pb = _by_candidate(a["tasks"][label]), _by_candidate(b["tasks"].get(label, {}))
        common = [n for n in pa if n in pb]
        if not common:
            print(f"{label:<12} no candidate judged in both runs")
            continue
        # a run cut by its budget may have judged another mix of candidates: compare the same ones, each by
        # its median, and the time per candidate as the mean of those medians
        tb = statistics.mean(pb[n]["median"] for n in common)
        ta = statistics.mean(pa[n]["median"] for n in common)
        worst = max(worst, ta / tb)
        print(f"{label:<12} time per candidate: before {tb:.2f} s  after {ta:.2f} s  x{ta / tb:.2f}")
        for n in common:
            sb, sa = pb[n], pa[n]
            print(f"{'':<14}{n:<18} {sb['median']:.2f} s (n={sb['n']}) -> {sa['median']:.2f} s (n={sa['n']})"
                  f"  x{sa['median'] / sb['median']:.2f}")  # fmt: skip
    if not worst:
        print("nothing to compare")
        return 1
    print(f"worst ratio x{worst:.2f}: {'within' if worst <= 1 + limit else 'ABOVE'} the {limit:.0%} limit")
    return 0


def _by_candidate(rec: dict) -> dict[str, dict[str, float]]:
    by: dict[str, list[float]] = {}
    for e in rec.get("evals", []):
        by.setdefault(e["candidate"], []).append(e["wall_s"])
    return {name: _stats(xs) for name, xs in by.items()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", type=Path, default=ROOT, help="root of the KernelArc checkout whose guard is timed")
    ap.add_argument("--out", help="JSON file (rewritten after every candidate)")
    ap.add_argument("--device", help="cuda:0 where CUDA is available, else cpu")
    ap.add_argument("--tasks", default="rmsnorm,h2048", help="comma list: rmsnorm (built-in), h2048 (024 problem)")
    ap.add_argument("--problem", help=f"folder of {PROBLEM} (default: ../shared or .shared beside the checkout)")
    ap.add_argument("--candidates", default=",".join(CANDIDATES), help=f"comma list of {', '.join(CANDIDATES)}")
    ap.add_argument("--repeats", type=int, default=2, help="times each candidate is judged (a fresh source each)")
    ap.add_argument("--workloads", help="comma list of workload indices (default: all on a GPU, small ones on CPU)")
    ap.add_argument("--cpu-max-bytes", type=int, default=256 << 10, help="CPU: workloads moving at most this")
    ap.add_argument("--budget-s", type=float, default=1e9, help="no new candidate after this many seconds")
    ap.add_argument("--warmup", type=int, help="1: judge a Triton candidate once untimed first (default on a GPU)")
    ap.add_argument("--commit", help="label of the tree in the output (default: its .commit file or git HEAD)")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"), help="compare two JSON files")
    ap.add_argument("--limit", type=float, default=0.20, help="--compare: allowed slowdown")
    ap.add_argument(
        "--profile",
        type=Path,
        help="cProfile the judge and every worker into this folder, then "
        "print where the time went (distorts the wall times: a diagnostic, not a measurement)",
    )
    args = ap.parse_args()
    if args.compare:
        return compare(*args.compare, args.limit)
    args.tasks = [t for t in args.tasks.split(",") if t]
    args.candidates = [c for c in args.candidates.split(",") if c]
    unknown = [c for c in args.candidates if c not in CANDIDATES] + [t for t in args.tasks if t not in TASKS]
    if unknown:
        ap.error(f"unknown candidates or tasks: {unknown}")
    tree = args.tree.resolve()
    if not (tree / "kernelarc" / "guard" / "judge.py").is_file():
        ap.error(f"{tree} is not a KernelArc tree (no kernelarc/guard/judge.py)")
    _use_tree(tree)
    # `timeout` sends SIGTERM: leave through the finally clauses, which close the guard and its workers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    import torch

    device = args.device or ("cuda:0" if torch.cuda.is_available() else "cpu")
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the workers (and triton) start
    import kernelarc
    from kernelarc.tasks.loader import load_builtin, load_task

    if not Path(kernelarc.__file__).resolve().is_relative_to(tree):
        print(f"kernelarc imported from {kernelarc.__file__}, not from {tree}", file=sys.stderr)
        return 2
    import logging

    logging.basicConfig(level=logging.WARNING)
    if args.warmup is None:
        args.warmup = int(device != "cpu")
    commit = args.commit or _commit_of(tree)
    out: dict[str, Any] = {"tree": str(tree), "commit": commit, "device": device, "torch": torch.__version__,
                           "candidates": args.candidates, "repeats": args.repeats, "tasks": {}}  # fmt: skip
    if device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name(device)
    t0 = time.monotonic()
    prof = _start_profile(args.profile) if args.profile else None  # after kernelarc's import from the tree
    for label in args.tasks:
        if label == "rmsnorm":
            task = load_builtin("rmsnorm", cpu=device == "cpu")
        else:
            p = _find_problem(args.problem)
            if p is None:
                print(f"{PROBLEM} not found in ../shared or .shared; skipped", file=sys.stderr)
                continue
            task = load_task(p)
        measure_task(label, task, tree, device, args, out)
    out["total_s"] = time.monotonic() - t0
    _write(args.out, out)
    print(_table(out))
    if prof is not None:
        _report_profile(*prof, args.profile)
    return 0


def _start_profile(where: Path) -> tuple[Any, Path]:
    """Wall seconds and calls of the judge's steps (the workers' step timer, ``StepProfile``, on the guard's
    classes) and, through KERNELARC_PROFILE_DIR, of every worker's; the folder the workers write to."""
    import tempfile

    from kernelarc.guard import buffers, drive, judge
    from kernelarc.guard.worker import StepProfile

    where.mkdir(parents=True, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="kernelarc-profile-")  # in /tmp: workers run as other users where root judges
    os.chmod(tmp, 0o777)
    os.environ["KERNELARC_PROFILE_DIR"] = tmp
    prof = StepProfile(str(where / "judge.json"))
    steps = [(judge.Guard, n) for n in ("_check_outputs", "reference", "_finish", "_drive", "evaluate")]
    steps += [(drive.Driver, n) for n in ("burst", "time_workload", "cross_check")]
    steps += [(judge, "compare_output"), (buffers.JudgeBuffer, "read")]
    for obj, name in steps:
        prof.wrap(obj, name, f"judge.{name}")
    return prof, Path(tmp)


def _report_profile(prof: Any, tmp: Path, where: Path) -> None:
    import shutil

    prof.flush()
    spent = prof.spent
    n_evals = int(spent.get("judge.evaluate", [0, 0])[1])  # every evaluation, the reference's and warm-ups too
    workers: dict[str, list[float]] = {}
    for f in sorted(tmp.glob("worker-*.json")):
        shutil.copy(f, where / f.name)
        for k, v in json.loads(f.read_text()).items():
            acc = workers.setdefault(k, [0.0, 0])
            acc[0] += v["s"]
            acc[1] += v["n"]
    shutil.rmtree(tmp, ignore_errors=True)
    rows = {"judge": spent, "workers (summed)": workers}
    (where / "profile.json").write_text(json.dumps({"evaluations": n_evals, **rows}, indent=1))
    for label, d in rows.items():
        print(f"--- {label}: seconds per evaluation ({n_evals} evaluations), calls per evaluation")
        for k, (sec, n) in sorted(d.items(), key=lambda kv: -kv[1][0]):
            per, calls, each = sec / max(n_evals, 1), n / max(n_evals, 1), 1e3 * sec / max(n, 1)
            print(f"  {k:34s} {per:8.4f} s  {calls:7.1f} calls  {each:8.3f} ms/call")


if __name__ == "__main__":
    sys.exit(main())
