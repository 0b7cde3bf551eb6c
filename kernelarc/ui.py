"""Terminal progress and the closing summary (the CLI's only prints)."""

from __future__ import annotations

import sys
from typing import Any

from kernelarc.models import Candidate, Status, Verdict

_MARK = {
    Status.champion: "★ champion",
    Status.correct_slower: "✓ slower",
    Status.incorrect: "✗ incorrect",
    Status.compile_error: "✗ compile",
    Status.runtime_error: "✗ runtime",
    Status.timeout: "✗ timeout",
    Status.rejected_hack: "✗ REJECTED",
}


class Progress:
    def __init__(self, enabled: bool = True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stdout

    def line(self, text: str) -> None:
        if self.enabled:
            print(text, file=self.stream, flush=True)

    def candidate(self, index: int, budget: int, cand: Candidate, v: Verdict, champion_ms: float | None) -> None:
        lat = f"{v.latency_ms:.4f} ms" if v.latency_ms else "-"
        vs = f" {v.speedup_vs_champion:.2f}x champ" if v.speedup_vs_champion else ""
        sb = f" {v.speedup_vs_baseline:.2f}x base" if v.speedup_vs_baseline else ""
        champ = f" | champion {champion_ms:.4f} ms" if champion_ms else ""
        knobs = ",".join(f"{k}={val}" for k, val in list(cand.knobs.items())[:6])
        err = f" | {v.errors[0].splitlines()[0][:80]}" if v.errors and not v.correct else ""
        self.line(
            f"[{index:>3}/{budget}] {cand.agent:<16.16} {(cand.family or cand.language):<28.28} "
            f"{_MARK[v.status]:<11} {lat}{vs}{sb}{champ} {knobs[:60]}{err}"
        )

    def summary(self, rows: list[tuple[str, Any]]) -> None:
        if not self.enabled:
            return
        width = max(len(k) for k, _ in rows)
        self.line("")
        self.line("=" * (width + 40))
        for k, v in rows:
            if isinstance(v, float):
                v = f"{v:.4g}"
            self.line(f"{k:<{width}}  {v}")
        self.line("=" * (width + 40))
