"""Plateau detection: when the champion stops improving, push the team elsewhere."""

from __future__ import annotations

from dataclasses import dataclass, field

REDIRECTS = (
    "rotate strategies: each agent takes the next strategy",
    "branch from a backup: start from the best correct-but-slower candidate",
    "explore a different family: restart from another kernel family or a random point",
)


@dataclass
class PlateauEvent:
    at_candidate: int
    since_gain: int
    action: str


@dataclass
class PlateauDetector:
    """Fires after ``patience`` evaluated candidates without a champion gain."""

    patience: int = 10
    since_gain: int = 0
    fired: int = 0
    events: list[PlateauEvent] = field(default_factory=list)

    def update(self, promoted: bool, candidate_index: int) -> PlateauEvent | None:
        if promoted:
            self.since_gain = 0
            return None
        self.since_gain += 1
        if self.patience > 0 and self.since_gain >= self.patience:
            action = REDIRECTS[self.fired % len(REDIRECTS)]
            ev = PlateauEvent(candidate_index, self.since_gain, action)
            self.fired += 1
            self.since_gain = 0
            self.events.append(ev)
            return ev
        return None
