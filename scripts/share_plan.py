"""What the guard's memory plan gives each problem of a tree at given per-session shares (guard.memory_gb), from
the definitions' sizes alone (no GPU, no dry run: the reference's working memory is left out, so a lower bound of
the need): the workloads it runs of the ones a suite session would (suite.workloads), its seeds and its workers.
Used to choose scripts/suite_45.sh's MEM_GB (twenty-ninth session: 11 GB shares leave 12 of the 45 problems
without a workload and 12 with fewer seeds; 17 GB shares, 7 and 7).

    python3 scripts/share_plan.py ../shared/sol-execbench 11 17 [--workloads 2] [--override KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tree", type=Path, help="a folder of problems (*/*/definition.json)")
    ap.add_argument("shares", type=float, nargs="+", help="guard.memory_gb values to plan at")
    ap.add_argument("--workloads", type=int, default=2, help="suite.workloads (default 2, the measured run's)")
    ap.add_argument("--override", action="append", default=[], help="a further Hydra override (repeatable)")
    a = ap.parse_args(argv)
    logging.disable(logging.WARNING)  # the plan logs every left-out workload; the table says it once

    from hydra import compose, initialize_config_dir

    from kernelarc.guard.memory import plan_memory, plan_settings
    from kernelarc.suite import session_workloads

    overrides = [f"suite.workloads={a.workloads}", "executor.parallel=2", f"dir={a.tree.resolve()}", *a.override]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    totals = {s: [0, 0, 0] for s in a.shares}
    for d in sorted(a.tree.glob("*/*/definition.json")):
        problem = d.parent
        task, gs, wls = session_workloads(cfg, problem, False)
        settings = plan_settings(gs)
        cells = []
        for share in a.shares:
            plan = plan_memory(task, wls, "cuda:0", **{**settings, "memory_gb": share})
            t = totals[share]
            t[0] += len(plan.runnable) < len(wls)
            t[1] += bool(plan.runnable) and plan.seeds < settings["seeds"]
            t[2] += bool(plan.runnable) and plan.max_workers < settings["parallel"]
            cells.append(f"{share:g} GB: {len(plan.runnable)}/{len(wls)} workloads, {plan.seeds} seeds, "
                         f"{plan.max_workers} workers")  # fmt: skip
        print(f"{problem.parent.name}/{problem.name[:32]:32s}  " + " | ".join(cells))
    for share, (lost, seeds, workers) in totals.items():
        print(f"at {share:g} GB: {lost} without a workload, {seeds} with fewer seeds, {workers} with fewer workers")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
