"""The session's state log: every measurement, appended as it is made, the source of truth for resume."""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path

from kernelarc.models import Candidate, Verdict


@dataclass
class Record:
    index: int  # 0-based count of evaluated candidates; -1 for baselines
    kind: str  # candidate | baseline | incumbent | rematch | final
    candidate: Candidate
    verdict: Verdict
    samples: dict[int, list[float]] = field(default_factory=dict)
    champion_id: str | None = None
    run_id: str | None = None
    version: int | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "index": self.index, "kind": self.kind, "candidate": self.candidate.model_dump(),
                "verdict": self.verdict.model_dump(mode="json"),
                "samples": {str(k): v for k, v in self.samples.items()},
                "champion_id": self.champion_id, "run_id": self.run_id, "version": self.version,
            }
        )  # fmt: skip

    @classmethod
    def from_json(cls, line: str) -> Record:
        d = json.loads(line)
        return cls(
            index=d["index"], kind=d["kind"], candidate=Candidate.model_validate(d["candidate"]),
            verdict=Verdict.model_validate(d["verdict"]), samples={int(k): v for k, v in d["samples"].items()},
            champion_id=d.get("champion_id"), run_id=d.get("run_id"), version=d.get("version"),
        )  # fmt: skip


class StateLog:
    """Append-only JSONL of every measurement; the source of truth for resume."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = directory / "evaluations.jsonl"
        self.meta_path = directory / "session.json"
        self._lock = threading.Lock()

    def load(self) -> list[Record]:
        out = []
        if self.path.is_file():
            for line in self.path.read_text().splitlines():
                try:
                    out.append(Record.from_json(line))
                except (ValueError, KeyError):
                    continue  # torn last line after a kill
        return out

    def append(self, rec: Record) -> None:
        with self._lock, self.path.open("a") as f:
            f.write(rec.to_json() + "\n")
            f.flush()
            os.fsync(f.fileno())

    def meta(self) -> dict:
        return json.loads(self.meta_path.read_text()) if self.meta_path.is_file() else {}

    def save_meta(self, meta: dict) -> None:
        tmp = self.meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(self.meta_path)
