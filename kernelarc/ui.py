"""Terminal progress and the closing summary (the CLI's only prints).

On a terminal: a live ``rich`` bar over the candidate budget with the champion's latency, the verdict
counts and the plateau events, the candidate lines scrolling above it, and a closing table. Elsewhere
(CI, pipes, tests): the same lines as plain text, no bar and no colour. Candidate lines stay under 100
characters; the closing table ends with the commands that open the MLflow UI and export the champion.
"""

from __future__ import annotations

import atexit
import sys
import threading
from collections import Counter
from typing import Any

from kernelarc.models import Candidate, Status, Verdict

LINE_WIDTH = 99
_MARK = {
    Status.champion: "★ champion",
    Status.correct_slower: "✓ slower",
    Status.incorrect: "✗ incorrect",
    Status.compile_error: "✗ compile",
    Status.runtime_error: "✗ runtime",
    Status.timeout: "✗ timeout",
    Status.rejected_hack: "✗ REJECTED",
}
_SHORT = {
    Status.champion: "★",
    Status.correct_slower: "✓",
    Status.incorrect: "✗inc",
    Status.compile_error: "✗cc",
    Status.runtime_error: "✗rt",
    Status.timeout: "✗to",
    Status.rejected_hack: "✗hack",
}
PLATEAU_MARK = "⟳"  # the session's plateau lines start with it


def candidate_line(index: int, budget: int, cand: Candidate, v: Verdict, champion_ms: float | None) -> str:
    """One line per verdict, at most ``LINE_WIDTH`` characters: index, agent, family, verdict, latency,
    speedup vs the champion, then the knobs or the first error line in what room is left."""
    lat = f"{v.latency_ms:.4f} ms" if v.latency_ms else "-"
    vs = f" {v.speedup_vs_champion:.2f}x" if v.speedup_vs_champion else ""
    head = (
        f"[{index:>3}/{budget}] {cand.agent:<14.14} {(cand.family or cand.language):<22.22} "
        f"{_MARK[v.status]:<11} {lat:>11}{vs}"
    )
    if v.errors and not v.correct:
        tail = v.errors[0].splitlines()[0] if v.errors[0] else ""
    else:
        tail = ",".join(f"{k}={val}" for k, val in cand.knobs.items())
    room = LINE_WIDTH - len(head) - 1
    if tail and room > 4:
        head += " " + (tail if len(tail) <= room else tail[: room - 1] + "…")
    return head[:LINE_WIDTH]


class Progress:
    def __init__(self, enabled: bool = True, stream=None, live: bool | None = None):
        """``live``: draw the rich bar (None: only when ``stream`` is a terminal)."""
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.live = bool(enabled and (self.stream.isatty() if live is None else live))
        self.counts: Counter[Status] = Counter()
        self.plateaus = 0
        self.champion_ms: float | None = None
        self._bar = None
        self._task_id = None
        self._console = None
        self._lock = threading.Lock()
        if self.live:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False)

    # -- lines ---------------------------------------------------------------------
    def line(self, text: str) -> None:
        if not self.enabled:
            return
        if text.lstrip().startswith(PLATEAU_MARK):
            self.plateaus += 1
            self._refresh()
        if self._console is not None:
            self._console.print(text, markup=False)
        else:
            print(text, file=self.stream, flush=True)

    def candidate(self, index: int, budget: int, cand: Candidate, v: Verdict, champion_ms: float | None) -> None:
        self.counts[v.status] += 1
        self.champion_ms = champion_ms
        if self.live:
            self._ensure_bar(budget)
        self.line(candidate_line(index, budget, cand, v, champion_ms))
        if self._bar is not None:
            self._bar.update(self._task_id, completed=index, total=budget, status=self._status())

    # -- the live bar ---------------------------------------------------------------
    def _status(self) -> str:
        champ = f"champion {self.champion_ms:.4g} ms" if self.champion_ms else "no champion"
        counts = " ".join(f"{_SHORT[s]}{n}" for s, n in sorted(self.counts.items(), key=lambda kv: kv[0].value))
        return f"{champ} | {counts} | plateaus {self.plateaus}"

    def _ensure_bar(self, budget: int) -> None:
        with self._lock:
            if self._bar is not None:
                return
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as Bar

            self._bar = Bar(
                TextColumn("[bold]search"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.fields[status]}"),
                console=self._console,
                transient=False,
            )
            self._task_id = self._bar.add_task("search", total=budget, status=self._status())
            self._bar.start()
            atexit.register(self.close)

    def _refresh(self) -> None:
        if self._bar is not None:
            self._bar.update(self._task_id, status=self._status())

    def close(self) -> None:
        """Stop the live bar (idempotent)."""
        with self._lock:
            bar, self._bar = self._bar, None
        if bar is not None:
            bar.stop()

    # -- closing table ----------------------------------------------------------------
    def summary(self, rows: list[tuple[str, Any]], commands: list[tuple[str, str]] | None = None) -> None:
        """The session's results, then the commands to go on with (open the UI, export the champion)."""
        self.close()
        if not self.enabled:
            return
        values = [(k, f"{v:.4g}" if isinstance(v, float) else str(v)) for k, v in rows]
        if self._console is not None:
            from rich.table import Table

            table = Table(show_header=False, box=None, pad_edge=False)
            table.add_column(style="bold")
            table.add_column()
            for k, v in values:
                table.add_row(k, v)
            self._console.rule("KernelArc")
            self._console.print(table)
            self._console.rule()
            for label, cmd in commands or []:
                self._console.print(f"{label}:", style="bold")
                self._console.print(f"  {cmd}", markup=False, soft_wrap=True)
            return
        width = max(len(k) for k, _ in values)
        self.line("")
        self.line("=" * (width + 40))
        for k, v in values:
            self.line(f"{k:<{width}}  {v}")
        self.line("=" * (width + 40))
        for label, cmd in commands or []:
            self.line(f"{label}:")
            self.line(f"  {cmd}")


def next_steps(cfg: Any, summary: dict[str, Any], experiment_id: str | None) -> list[tuple[str, str]]:
    """The commands that open this session in the MLflow UI and export its champion."""
    from kernelarc.tracking import default_tracking_uri, ui_url

    steps: list[tuple[str, str]] = []
    uri = cfg.tracking.uri or default_tracking_uri()
    if cfg.tracking.enabled:
        where = ui_url(experiment_id) if experiment_id else "http://127.0.0.1:5000"
        if uri.startswith("sqlite:"):
            steps.append(("open the MLflow UI", f"mlflow ui --backend-store-uri {uri} --port 5000   # then {where}"))
        else:
            steps.append(("open the MLflow UI", where.replace("http://127.0.0.1:5000", uri.rstrip("/"))))
    if cfg.tracking.enabled and cfg.tracking.register and summary.get("registry_version") is not None:
        task = f"+task={cfg.task.name}" + (f" task.path={cfg.task.path}" if cfg.task.path else "")
        tracking = f" tracking.uri={cfg.tracking.uri}" if cfg.tracking.uri else ""
        steps.append(
            (
                "export the champion",
                f"python -m kernelarc.export {task} gpu={summary.get('gpu')} format=sol-execbench out=exported"
                + tracking,
            )
        )
    return steps
