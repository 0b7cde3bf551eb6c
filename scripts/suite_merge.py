#!/usr/bin/env python3
"""One table from the suite tables of several device calls (the suite over all 45 problems takes two or three).

Each argument is ``LABEL=path/to/suite_table.json`` (the file ``scripts/gpu_suite.sh`` writes under ``$OUT``);
a later argument's row replaces an earlier one's for the same problem (a call that ran a problem again). A row
whose session was stopped by its call's end is kept only where no finished row exists. Prints the suite's own
closing lines (built champions, geomean over the problems with a torch.compile figure), issue 14's two
measures over every problem (built and not behind torch.compile on either ratio; geomean counting a problem
without a figure as 1.0), then a markdown table with each row's call label.

    python3 scripts/suite_merge.py DQ=runs/dq/suite_table.json DR=runs/dr/suite_table.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernelarc.suite import ProblemResult, geomean, is_kernelarc_built, render_table  # noqa: E402


def merge(tables: list[tuple[str, list[dict]]]) -> list[tuple[str, ProblemResult]]:
    """(label, row) per problem, sorted by problem: the last finished row wins, a stopped one only if alone."""
    best: dict[str, tuple[str, ProblemResult]] = {}
    for label, rows in tables:
        for raw in rows:
            r = ProblemResult.model_validate(raw)
            old = best.get(r.problem)
            if old is None or not r.stopped or old[1].stopped:
                best[r.problem] = (label, r)
    return [best[k] for k in sorted(best)]


def not_behind(r: ProblemResult) -> bool:
    """Built, finished, and at least as fast as torch.compile on both ratios where one was measured."""
    ratios = [v for v in (r.speedup_vs_compile, r.speedup_vs_compile_drift_corrected) if v]
    return is_kernelarc_built(r) and not r.stopped and all(v >= 1.0 for v in ratios)


def _f(v: float | None) -> str:
    return f"{v:.2f}" if v else "-"


def report(merged: list[tuple[str, ProblemResult]]) -> str:
    rows = [r for _, r in merged]
    table = render_table(rows).splitlines()
    # the suite's closing lines: those after its last rule (the timing line only where verdicts were counted)
    lines = table[max(i for i, line in enumerate(table) if line and set(line) == {"-"}) + 1 :]
    n = len(rows)
    lines.append(f"built and not behind torch.compile on either ratio, finished: {sum(map(not_behind, rows))} of {n}")
    lines.append(
        f"geomean x torch.compile over all {n} (1.0 where none was measured): "
        f"{_f(geomean([r.speedup_vs_compile or 1.0 for r in rows]))} "
        f"(drift-corrected {_f(geomean([r.speedup_vs_compile_drift_corrected or 1.0 for r in rows]))})"
    )
    lines += ["", "| problem | call | champion | built | x tc (dc) | n | min |", "|---|---|---|---|---|---|---|"]
    for label, r in merged:
        group, _, rest = r.problem.partition("/")
        name = f"{group.replace('-Bench', '')} {rest.split('_')[0]}"
        champ = re.sub(r"^composed\.[^.]+\.", "composed ", r.champion_family or r.status.value)
        if r.champion_graph_level_only:
            champ += " (graph-level only)"
        if r.stopped:
            champ += " (stopped)"
        built = is_kernelarc_built(r)
        tc = f"{_f(r.speedup_vs_compile)}{'*' if r.compile_after_budget else ''} "
        tc += f"({_f(r.speedup_vs_compile_drift_corrected)})"
        mins = f"{r.elapsed_min:.1f}" if r.elapsed_min else "-"
        lines.append(f"| {name} | {label} | {'**' + champ + '**' if built else champ} | {'yes' if built else 'no'} "
                     f"| {tc} | {r.evaluated} | {mins} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="+", metavar="LABEL=PATH")
    args = ap.parse_args(argv)
    tables = []
    for arg in args.tables:
        label, sep, path = arg.partition("=")
        if not sep or not label or not path:
            ap.error(f"{arg!r}: expected LABEL=path/to/suite_table.json")
        try:
            rows = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            ap.error(f"{path}: {e}")
        if not isinstance(rows, list):
            ap.error(f"{path}: not a list of suite rows")
        tables.append((label, rows))
    print(report(merge(tables)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
