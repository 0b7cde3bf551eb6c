"""The board: bounded shared memory of conclusions.

Agents share only findings (what worked or failed, and why: one line each), never
transcripts. ``memory.limit`` bounds what an agent is shown: 0 nothing, k the k most
useful findings, None all of them. The board is an append-only JSONL file, so a killed
session resumes with everything it had learned.
"""

from __future__ import annotations

import threading
from pathlib import Path

from kernelarc.models import Finding, Status
from kernelarc.tracking import scrub_text


def usefulness(f: Finding) -> float:
    """Champions and large gains first; failures next (they save repeating a mistake)."""
    gain = abs(f.gain) if f.gain is not None else 0.0
    if f.status is Status.champion:
        base = 3.0
    elif f.status is Status.correct_slower:
        base = 1.0
    elif f.status in (Status.rejected_hack, Status.incorrect):
        base = 1.5
    else:
        base = 1.2
    return base * (1.0 + min(gain, 10.0))


class Board:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._findings: list[Finding] = []
        if self.path and self.path.is_file():
            for line in self.path.read_text().splitlines():
                if line.strip():
                    try:
                        self._findings.append(Finding.model_validate_json(line))
                    except ValueError:
                        continue  # a line torn by a kill: the rest is still good

    def __len__(self) -> int:
        return len(self._findings)

    def post(self, finding: Finding) -> Finding:
        # Lessons can come from a language model's reply: never let a secret reach the board file.
        lesson = scrub_text(finding.lesson)
        with self._lock:
            finding = finding.model_copy(update={"seq": len(self._findings), "lesson": lesson})
            self._findings.append(finding)
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write(finding.model_dump_json() + "\n")
                    f.flush()
        return finding

    def all(self) -> list[Finding]:
        with self._lock:
            return list(self._findings)

    def view(self, limit: int | None) -> list[Finding]:
        """What an agent sees: bounded by ``limit`` (0: none, k: the k most useful, None: all)."""
        findings = self.all()
        if limit is None:
            return findings
        if limit <= 0:
            return []
        ranked = sorted(findings, key=lambda f: (usefulness(f), f.seq), reverse=True)[:limit]
        return sorted(ranked, key=lambda f: f.seq)
