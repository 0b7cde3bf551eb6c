#!/usr/bin/env python3
"""One table from the suite tables of several device calls (the suite over all 45 problems takes two or three).

Each argument is ``LABEL=path/to/suite_table.json`` (the file ``scripts/gpu_suite.sh`` writes under ``$OUT``);
a later argument's row replaces an earlier one's for the same problem (a call that ran a problem again), unless
it ranks lower: finished over stopped by its call's end over crashed (``stands``). Prints the suite's own
closing lines (built champions, geomean over the problems with a torch.compile figure), issue 14's two
measures over every problem (built and not behind torch.compile on either ratio; geomean counting a problem
without a figure as 1.0), then a markdown table with each row's call label.

    python3 scripts/suite_merge.py DQ=runs/dq/suite_table.json DR=runs/dr/suite_table.json

``--collect OUT`` (``scripts/gpu_suite.sh``, also when its call is cut short) writes ``OUT/suite_table.json`` from
the shards' tables and result files under ``.kernelarc``, by the same rule. Only the report imports torch.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

if TYPE_CHECKING:
    from kernelarc.suite import ProblemResult


def rank(row: dict[str, Any]) -> int:
    """A row's standing among the rows of its problem: finished 2, stopped by its call's end 1, crashed 0."""
    return 0 if row.get("status") == "crashed" else 1 if row.get("stopped") else 2


def stands(row: dict[str, Any], old: dict[str, Any] | None) -> bool:
    """Whether ``row``, the later one, replaces ``old`` (the same problem's row so far)."""
    return old is None or rank(row) >= rank(old)


def merge(tables: list[tuple[str, list[dict]]]) -> list[tuple[str, ProblemResult]]:
    """(label, row) per problem, sorted by problem: the last row of the highest rank (``stands``)."""
    from kernelarc.suite import ProblemResult

    best: dict[str, tuple[str, dict]] = {}
    for label, rows in tables:
        for raw in rows:
            if stands(raw, best.get(raw["problem"], (None, None))[1]):
                best[raw["problem"]] = (label, raw)
    return [(best[k][0], ProblemResult.model_validate(best[k][1])) for k in sorted(best)]


def collect(state: Path, out: Path) -> int:
    """``out/suite_table.json`` from every shard's ``table.json`` and result files under ``state`` (a shard killed
    before it wrote its table left its result files: run DW); returns the number of rows."""
    rows: dict[str, dict] = {}

    def keep(row: dict) -> None:
        if stands(row, rows.get(row["problem"])):
            rows[row["problem"]] = row

    for r in sorted(state.glob("suite_shard*/*/*/results/*.json")):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            keep(json.loads(r.read_text()))
    for t in sorted(state.glob("suite_shard*/*/*/table.json")):
        try:
            data = json.loads(t.read_text())
            for row in data if isinstance(data, list) else data.get("rows", data.get("results", [])):
                keep(row)
        except (OSError, ValueError, KeyError, AttributeError, TypeError) as e:
            print(f"{t}: unreadable ({e}); its result files stand in")
    table = sorted(rows.values(), key=lambda r: r["problem"])
    (out / "suite_table.json").write_text(json.dumps(table, indent=1))
    return len(table)


def not_behind(r: ProblemResult) -> bool:
    """Built, finished, and at least as fast as torch.compile on both ratios where one was measured."""
    from kernelarc.suite import is_kernelarc_built

    ratios = [v for v in (r.speedup_vs_compile, r.speedup_vs_compile_drift_corrected) if v]
    return is_kernelarc_built(r) and not r.stopped and all(v >= 1.0 for v in ratios)


def _f(v: float | None) -> str:
    return f"{v:.2f}" if v else "-"


def report(merged: list[tuple[str, ProblemResult]]) -> str:
    from kernelarc.suite import geomean, is_kernelarc_built, render_table

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
        if r.workloads_not_run and r.workloads:
            champ += f" ({len(r.workloads) - len(r.workloads_not_run)} of {len(r.workloads)} workloads)"
        built = is_kernelarc_built(r)
        tc = f"{_f(r.speedup_vs_compile)}{'*' if r.compile_after_budget else ''} "
        tc += f"({_f(r.speedup_vs_compile_drift_corrected)})"
        mins = f"{r.elapsed_min:.1f}" if r.elapsed_min else "-"
        lines.append(f"| {name} | {label} | {'**' + champ + '**' if built else champ} | {'yes' if built else 'no'} "
                     f"| {tc} | {r.evaluated} | {mins} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tables", nargs="*", metavar="LABEL=PATH")
    ap.add_argument("--collect", metavar="OUT", type=Path, help="write OUT/suite_table.json from .kernelarc")
    args = ap.parse_args(argv)
    if args.collect is not None:
        print(f"suite_table.json: {collect(Path('.kernelarc'), args.collect)} rows")
        return 0
    if not args.tables:
        ap.error("LABEL=path/to/suite_table.json expected (one or more), or --collect OUT")
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
