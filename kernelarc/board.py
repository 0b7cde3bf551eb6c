"""The board: bounded shared memory of conclusions, kept as *wins* and *traps*.

Agents share only findings (what worked or failed, under which conditions, and why), never
transcripts. A **win** is a candidate the guard promoted over the champion of the time, or a
correct kernel faster than every earlier one of its family (a family record: while the library
leads, these are the points worth building on); a **trap** is anything else an agent should not
repeat: a failure (compile error, incorrect, hack, timeout) or a correct kernel that was no faster
than what its family already had.

``memory.limit`` bounds each list separately: 0 shows nothing, k the k best wins and the k most
recent traps, None everything. Wins are ranked best-first by their speed, measured as the gain
against the champion of the time and chained through the champion sequence (a win's speed is its
champion's speed times ``1 + gain``), so a large gain over a weak early champion does not outrank a
later, faster kernel. Traps are first in, first out: the most recent first, since the team moves on
and old traps describe regions it has left.

Beside the bounded lists, ``leaderboard()`` is the read-only leaderboard of the siblings' bests: each
agent's fastest correct kernel, shown whatever ``memory.limit`` is (the seed paper's design), so a
team without memory still knows where each of its members stands, as a lone agent knows from its own
history; memory adds the wins and traps around those points.

Each finding carries its conditions (family, knobs, the workloads' shapes it was measured on, the
champion it was timed against) and its reason (the guard's decision or the first error line). The
board is an append-only JSONL file, so a killed session resumes with everything it had learned
(lines written before wins and traps existed are classified on load).
"""

from __future__ import annotations

import logging
import threading
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel, Field

from kernelarc.models import Finding, Status
from kernelarc.tracking import scrub_text

log = logging.getLogger(__name__)


class Kind(StrEnum):
    win = "win"
    trap = "trap"


class Conditions(BaseModel):
    """Where and against what a finding was measured."""

    workloads: list[dict[str, int]] = Field(default_factory=list, description="Axes of each workload timed.")
    champion_id: str | None = None  # the champion it was compared with
    latency_ms: float | None = None


class Entry(Finding):
    """A finding on the board: a Finding (what every agent reads) with its kind, conditions, reason."""

    kind: Kind = Kind.trap
    conditions: Conditions = Field(default_factory=Conditions)
    reason: str = ""
    speed: float | None = Field(default=None, description="Speed relative to the session's first champion.")


# a family record must beat the family's best by this much to be a win (timing noise is not a gain)
RECORD_MARGIN = 0.01


def kind_of(f: Finding) -> Kind:
    """From the status alone: win iff the guard promoted it (the board also counts family records)."""
    k = getattr(f, "kind", None)
    if isinstance(k, Kind):
        return k
    return Kind.win if f.status is Status.champion else Kind.trap


class Board:
    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else None
        self._lock = threading.Lock()
        self._entries: list[Entry] = []
        self._speed: dict[str, float] = {}  # candidate id -> chained speed (wins and timed traps)
        self._family_best: dict[str, float] = {}  # family -> fastest chained speed posted
        self._win_ids: set[str] = set()
        if self.path and self.path.is_file():
            for line in self.path.read_text().splitlines():
                if not line.strip():
                    continue
                try:
                    e = Entry.model_validate_json(line)
                except ValueError:
                    continue  # a line torn by a kill: the rest is still good
                if "kind" not in line:  # written by an older board: classify from the status
                    e.kind = kind_of(Finding.model_validate_json(line))
                self._remember(e)

    def __len__(self) -> int:
        return len(self._entries)

    def _remember(self, e: Entry) -> None:
        self._entries.append(e)
        if e.kind is Kind.win:
            self._win_ids.add(e.candidate_id)
        if e.speed is not None:
            self._speed[e.candidate_id] = e.speed
            if e.family and e.status.correct:
                self._family_best[e.family] = max(self._family_best.get(e.family, 0.0), e.speed)

    def post(self, finding: Finding, *, conditions: Conditions | None = None, reason: str = "") -> Entry:
        """Add a finding (its kind from the verdict's status); returns the stored entry."""
        # Lessons can come from a language model's reply: never let a secret reach the board file.
        lesson = scrub_text(finding.lesson)
        with self._lock:
            data = finding.model_dump()
            cond = conditions or getattr(finding, "conditions", None) or Conditions()
            data.update(seq=len(self._entries), lesson=lesson, kind=kind_of(finding), conditions=cond,
                        reason=scrub_text(reason or getattr(finding, "reason", "") or ""))  # fmt: skip
            if finding.gain is not None:
                base = self._speed.get(cond.champion_id or "", 1.0)
                data["speed"] = base * (1.0 + finding.gain)
                best = self._family_best.get(finding.family or "")
                record = (
                    finding.status.correct
                    and finding.family
                    and (best is None or data["speed"] > best * (1.0 + RECORD_MARGIN))
                )
                record = record or finding.candidate_id in self._win_ids  # a later lesson on a win
                if record and data["kind"] is Kind.trap and getattr(finding, "kind", None) is None:
                    data["kind"] = Kind.win  # a family record: the best point of its design so far
            entry = Entry.model_validate(data)
            self._remember(entry)
            if self.path:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                with self.path.open("a") as f:
                    f.write(entry.model_dump_json() + "\n")
                    f.flush()
        return entry

    def is_win(self, candidate_id: str) -> bool:
        """Whether the candidate is on the board as a win (promoted, or a family record): what the
        plateau breaker counts as progress (``PlateauDetector.update(..., record=...)``)."""
        with self._lock:
            return candidate_id in self._win_ids

    def all(self) -> list[Entry]:
        with self._lock:
            return list(self._entries)

    def wins(self, limit: int | None) -> list[Entry]:
        """The ``limit`` best wins, fastest first (one entry per candidate: its latest lesson)."""
        if limit is not None and limit <= 0:
            return []
        latest: dict[str, Entry] = {}
        for e in self.all():
            if e.kind is Kind.win:
                latest[e.candidate_id] = e
        ranked = sorted(latest.values(), key=lambda e: (e.speed if e.speed is not None else 0.0, e.seq), reverse=True)
        return ranked if limit is None else ranked[:limit]

    def traps(self, limit: int | None) -> list[Entry]:
        """The ``limit`` most recent traps, newest first (one entry per candidate)."""
        if limit is not None and limit <= 0:
            return []
        out: list[Entry] = []
        ids: set[str] = set()
        for e in reversed(self.all()):
            if e.kind is Kind.trap and e.candidate_id not in ids:
                ids.add(e.candidate_id)
                out.append(e)
                if limit is not None and len(out) >= limit:
                    break
        return out

    def leaderboard(self) -> list[Entry]:
        """Each agent's fastest correct kernel of a family (its latest lesson), fastest first."""
        best: dict[str, Entry] = {}
        for e in self.all():
            if not (e.status.correct and e.family and e.speed is not None and e.agent):
                continue
            cur = best.get(e.agent)
            if cur is None or e.speed > cur.speed or (e.candidate_id == cur.candidate_id and e.seq > cur.seq):
                best[e.agent] = e
        return sorted(best.values(), key=lambda e: (e.speed, e.seq), reverse=True)

    def view(self, limit: int | None) -> list[Entry]:
        """What an agent sees: the wins (best first), then the traps (newest first), each bounded by
        ``limit`` (0: none, k: k of each, None: all)."""
        return self.wins(limit) + self.traps(limit)
