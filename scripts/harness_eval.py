#!/usr/bin/env python3
"""NVIDIA's harness on a suite's champions (run on the GPU machine, after ``python -m kernelarc.suite``).

For every problem of a suite table whose champion is a searched kernel (``--all``: baselines
too), exports the registry's champion (``models:/kernelarc.<definition>.<gpu>@champion``) as a
destination-passing SOL-ExecBench solution, runs NVIDIA's own evaluator on it
(``sol_execbench.cli``, the vendored harness, over the workloads the suite searched or
``--workloads all``), each call bounded by ``timeout``, and writes its verdict back into the
suite table (``harness_verdict``, ``harness_passed``, ``harness_speedup``: the geometric mean of
its ``speedup_factor`` over PASSED workloads) and, when the suite has an MLflow run, into that
run. The exported solutions must run without KernelArc: the harness runs with only its own
source and wheels on ``PYTHONPATH``.

The harness's extra wheels (pydantic, cupti-python, ...) come from its ``wheels.sh``; install them
once on the GPU machine (see ../shared/sol-execbench-harness/README.md), e.g.
    python3 -m pip install -q --no-index --no-deps --target /tmp/solx .whl/solx/*.whl
    python3 scripts/harness_eval.py --suite .kernelarc/suite/h200/<key> --harness-path /tmp/solx
Never pass --lock-clocks to the harness here (it runs nvidia-smi -lgc).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
DEFAULT_HARNESS = ROOT.parent / "shared" / "sol-execbench-harness" / "src"


def parse_traces(stdout: str) -> list[dict]:
    """The harness's ``--json`` output: one Trace JSON object per line (other lines ignored)."""
    traces = []
    for line in stdout.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                traces.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return traces


def summarize(traces: list[dict]) -> tuple[str, str, float | None]:
    """(verdict, "passed/total", geomean speedup over PASSED workloads)."""
    statuses = [((t.get("evaluation") or {}).get("status") or "NO_EVALUATION") for t in traces]
    passed = [t for t, s in zip(traces, statuses, strict=True) if s == "PASSED"]
    speedups = [
        float(t["evaluation"]["performance"]["speedup_factor"])
        for t in passed
        if (t["evaluation"].get("performance") or {}).get("speedup_factor")
    ]
    geo = math.exp(sum(math.log(x) for x in speedups) / len(speedups)) if speedups else None
    if statuses and len(passed) == len(statuses):
        verdict = "PASSED"
    else:
        worst = Counter(s for s in statuses if s != "PASSED").most_common(1)
        verdict = worst[0][0] if worst else "NO_TRACES"
    return verdict, f"{len(passed)}/{len(statuses)}", geo


def run_harness(sol_dir: Path, problem: Path, workload_file: Path, harness_src: Path, extra_path: list[str],
                timeout_s: int) -> tuple[str, str, float | None]:  # fmt: skip
    env = dict(os.environ)
    # only the harness and its wheels: an exported solution may not need KernelArc installed
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, str(harness_src)])
    env["FLASHINFER_TRACE_DIR"] = str(problem)
    cmd = ["timeout", "--kill-after=30", str(timeout_s), sys.executable, "-c",
           "from sol_execbench.cli import cli; cli()", "--definition", str(problem / "definition.json"),
           "--workload", str(workload_file), "--solution", str(sol_dir / "solution.json"), "--json",
           "--timeout", str(max(60, timeout_s - 60)), "--compile-timeout", str(max(60, timeout_s // 4))]  # fmt: skip
    if (problem / "config.json").is_file():
        cmd += ["--config", str(problem / "config.json")]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 60, cwd=sol_dir, env=env)
    except subprocess.TimeoutExpired:
        return "TIMEOUT", "0/0", None
    (sol_dir / "harness.log").write_text(p.stderr)
    (sol_dir / "traces.jsonl").write_text(p.stdout)
    if p.returncode in (124, 137):
        return f"TIMEOUT ({timeout_s} s)", "0/0", None
    traces = parse_traces(p.stdout)
    if not traces:
        last = (p.stderr.strip().splitlines() or [f"exit code {p.returncode}"])[-1]
        return f"HARNESS_ERROR: {last[:200]}", "0/0", None
    for t in traces:  # the harness's reason for every workload it did not pass, in the log where it is read
        ev = t.get("evaluation") or {}
        if ev.get("status") != "PASSED":
            why = " ".join(str(ev.get("log") or ev).split())[:400]
            print(f"    {ev.get('status')} on workload {(t.get('workload') or {}).get('uuid', '?')}: {why}", flush=True)
    return summarize(traces)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suite", required=True, type=Path, help="the suite's results folder (holds table.json)")
    ap.add_argument("--harness-src", type=Path, default=DEFAULT_HARNESS, help="the vendored harness's src/")
    ap.add_argument("--harness-path", action="append", default=[], help="extra PYTHONPATH entry (its wheels)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per harness call (bounded by `timeout`)")
    ap.add_argument("--workloads", choices=("searched", "all"), default="searched")
    ap.add_argument("--all", action="store_true", help="also problems whose champion is a baseline")
    ap.add_argument("--again", action="store_true", help="judge again problems that already have a verdict")
    ap.add_argument("--problems", nargs="*", help="only these problems (as in the table)")
    ap.add_argument("--tracking-uri", default=None)
    ap.add_argument("--out", type=Path, default=None, help="exports and traces (default: <suite>/harness)")
    args = ap.parse_args()

    from kernelarc.exporting import export_for_task
    from kernelarc.registry import Registry
    from kernelarc.suite import ProblemStatus, load_table, render_table, slug, write_table
    from kernelarc.tasks.loader import load_task

    args.suite = args.suite.resolve()  # the harness runs in the solution's folder: absolute paths only
    meta = json.loads((args.suite / "suite.json").read_text())
    root, gpu = Path(meta["dir"]).resolve(), meta["gpu"]
    uri = args.tracking_uri or meta.get("tracking_uri")
    out = (args.out or args.suite / "harness").resolve()
    rows = load_table(args.suite / "table.json")
    wanted = {ProblemStatus.improved} | ({ProblemStatus.baseline} if args.all else set())
    for r in rows:
        if r.status not in wanted or (args.problems and r.problem not in args.problems):
            continue
        if r.harness_verdict and not args.again:  # judged by an earlier pass (e.g. searched kernels first)
            continue
        problem = root / r.problem
        sol_dir = out / slug(r.problem)
        try:
            task = load_task(problem)
            found = Registry(uri, task.name, gpu).champion()
            if found is None:
                r.harness_verdict, r.harness_passed, r.harness_speedup = "NO_CHAMPION_IN_REGISTRY", None, None
                continue
            version, cand, _tags = found
            export_for_task(cand, task, sol_dir, "sol-execbench", gpu, dps=True,
                            provenance={"registry_version": version, "suite": str(args.suite)})  # fmt: skip
        except Exception as e:  # noqa: BLE001 - one problem's export trouble is its row
            r.harness_verdict, r.harness_passed, r.harness_speedup = f"EXPORT_ERROR: {e}"[:200], None, None
            continue
        wl_file = problem / "workload.jsonl"
        if args.workloads == "searched" and r.workloads is not None:
            lines = [x for x in wl_file.read_text().splitlines() if x.strip()]
            wl_file = sol_dir / "workload.jsonl"
            wl_file.write_text("\n".join(lines[i] for i in r.workloads) + "\n")
        print(f"harness: {r.problem} (v{version}, {cand.family or cand.language}) ...", flush=True)
        r.harness_verdict, r.harness_passed, r.harness_speedup = run_harness(
            sol_dir, problem, wl_file, args.harness_src, args.harness_path, args.timeout
        )
        print(f"  {r.harness_verdict} {r.harness_passed} speedup {r.harness_speedup}", flush=True)
        write_table(rows, args.suite)  # after each problem: a kill keeps what was evaluated
    files = write_table(rows, args.suite)
    print(render_table(rows))
    for r in rows:
        if r.harness_verdict:
            sp = f"{r.harness_speedup:.2f}x" if r.harness_speedup else "-"
            print(f"{r.problem:<60} {r.harness_verdict:<24} {r.harness_passed or '-':>7} {sp:>7}")
    if meta.get("mlflow_run_id"):
        try:
            from mlflow import MlflowClient

            from kernelarc.tracking import default_tracking_uri

            c = MlflowClient(tracking_uri=uri or default_tracking_uri())
            n = sum(r.harness_verdict == "PASSED" for r in rows)
            c.log_metric(meta["mlflow_run_id"], "harness_passed_problems", n)
            for f in files:
                c.log_artifact(meta["mlflow_run_id"], str(f))
        except Exception as e:  # noqa: BLE001
            print(f"MLflow logging skipped: {e}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
