"""The plateau breaker: when the champion stops improving, send one agent to untried structure.

Only *benchmarked non-improvements* advance the counter: a candidate that was correct and timed
but not promoted (``correct_slower``) and no family record (``record=True``: the board's win).
Compile errors, runtime errors, timeouts, incorrect outputs and rejected hacks say nothing about
whether the current design has run out of speed (they were never timed), so they neither advance
nor reset it; a new champion or a family record resets it.

When it fires, the breaker redirects to structure the session has not measured yet, never to
variants of the baseline (the reference under other torch.compile settings is not a new design):

1. ``switch_language``: a family written in a language no benchmarked candidate used yet
   (e.g. CUTLASS when only Triton kernels were timed);
2. ``explore_family``: a family with no benchmarked candidate;
3. ``climb_family``: every family tried: the non-champion family with the fewest benchmarked
   candidates, climbed from its own best point;
4. ``new_structure``: the task has no kernel family: the (LLM) agents are told to change the
   algorithm, layout or language.

Shape-dispatch composition needs no firing: the session composes one after every verdict that
makes one promising. Each firing redirects one agent (round robin), so a team and a single agent
pay the same number of candidates for it; the event records what it changed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from enum import StrEnum

from kernelarc.models import Status


class Action(StrEnum):
    switch_language = "switch_language"
    explore_family = "explore_family"
    climb_family = "climb_family"
    new_structure = "new_structure"


@dataclass
class PlateauEvent:
    at_candidate: int
    since_gain: int  # benchmarked non-improvements that triggered it
    action: Action
    target_family: str | None  # the family the redirected agent must build next (None: new_structure)
    target_language: str | None
    from_family: str | None  # the champion's family when it fired
    agents: list[str] = field(default_factory=list)  # who was redirected (set by the session)

    @property
    def instruction(self) -> str:
        """What the redirected agent is told (LLM agents read this text)."""
        if self.target_family is None:
            return (f"plateau: {self.since_gain} timed candidates without a gain; change the algorithm, the "
                    "data layout or the language, not the settings of the current design")  # fmt: skip
        what = {
            Action.switch_language: f"switch to {self.target_language}: build the next kernel in family "
            f"{self.target_family}",
            Action.explore_family: f"explore family {self.target_family}, untried so far",
            Action.climb_family: f"climb family {self.target_family} from its best point",
        }[self.action]
        return f"plateau: {self.since_gain} timed candidates without a gain; {what}"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["action"] = self.action.value
        d["instruction"] = self.instruction
        return d


@dataclass
class PlateauDetector:
    """Fires after ``patience`` benchmarked non-improvements (0 disables it).

    ``families`` maps every kernel family of the task to its language (what "untried structure"
    is chosen from); language ``pytorch`` families are baseline variants and never a target.
    """

    patience: int = 10
    families: Mapping[str, str] = field(default_factory=dict)
    since_gain: int = 0
    fired: int = 0
    events: list[PlateauEvent] = field(default_factory=list)

    def update(
        self,
        status: Status | bool,
        candidate_index: int,
        *,
        tried: Mapping[str, int] | None = None,
        champion_family: str | None = None,
        record: bool = False,
    ) -> PlateauEvent | None:
        """``status``: the verdict's status (a bool is read as promoted / not promoted, timed).
        ``tried``: benchmarked candidates per family so far. ``record``: the board took the candidate
        as a win without a promotion (a family record: faster than anything its family had). While
        the library leads every family kernel is a non-improvement against the champion, yet a search
        that keeps setting family records is climbing, not stuck, so a record resets the counter too."""
        if isinstance(status, bool):
            status = Status.champion if status else Status.correct_slower
        if status is Status.champion or (record and status.correct):
            self.since_gain = 0
            return None
        if status is not Status.correct_slower:
            return None  # never timed: says nothing about a plateau
        self.since_gain += 1
        if self.patience <= 0 or self.since_gain < self.patience:
            return None
        ev = self._redirect(candidate_index, dict(tried or {}), champion_family)
        self.fired += 1
        self.since_gain = 0
        self.events.append(ev)
        return ev

    def _redirect(self, at: int, tried: dict[str, int], champ: str | None) -> PlateauEvent:
        fams = {n: lang for n, lang in self.families.items() if lang != "pytorch"}
        used_langs = {fams[n] for n, c in tried.items() if c > 0 and n in fams}
        untried = [n for n in fams if tried.get(n, 0) == 0]
        new_lang = [n for n in untried if fams[n] not in used_langs]
        if new_lang:
            action, target = Action.switch_language, new_lang[0]
        elif untried:
            action, target = Action.explore_family, untried[0]
        else:
            others = [n for n in fams if n != champ]
            if not others:
                return PlateauEvent(at, self.since_gain, Action.new_structure, None, None, champ)
            # fewest timed candidates first; ties in the order the task lists its families
            target = min(others, key=lambda n: tried.get(n, 0))
            action = Action.climb_family
        return PlateauEvent(at, self.since_gain, action, target, fams[target], champ)
