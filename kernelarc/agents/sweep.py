"""Sweep agents (``agents.backend=sweep``): one kernel family's points from a grid or a list,
each proposed once, in order.

Where the search agents climb, a sweep measures: every feasible point of ``agents.sweep.grid``
(knob -> values; knobs left out stay at the family's start) or exactly ``agents.sweep.points``.
The candidates go through the same guard, tracking, champion rule and shape dispatch as a search's,
so a sweep answers "is there a point of this space that beats the library on this shape at all?"
with the same evidence as a search, and a search's reach can be judged against it. With
``agents.count`` > 1 the agents take disjoint shares (every count-th point), so a session's
parallel evaluation slots stay full.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from kernelarc.agents.base import AgentContext, Proposal
from kernelarc.families.base import Family
from kernelarc.models import Candidate, Status, Verdict


class SweepError(ValueError):
    """A sweep that names no family, an unknown family or knob, or a value outside a knob's values."""


def find_family(task_name: str, name: str | None) -> Family:
    from kernelarc.families import families_for

    fams = {f.name: f for f in families_for(task_name)}
    if not name:
        raise SweepError(f"agents.sweep.family is required for a sweep; families of {task_name}: {', '.join(fams)}")
    if name not in fams:
        raise SweepError(f"no family {name!r} for task {task_name} here; families: {', '.join(fams)}")
    return fams[name]


def sweep_points(
    fam: Family, grid: Mapping[str, Sequence[Any]] | None = None, points: Sequence[Mapping[str, Any]] | None = None
) -> list[dict[str, Any]]:
    """The feasible points of ``grid`` (product over its knobs, the others at the family's start) or
    of ``points`` (each completed from the start), in order, without repeats. Unknown knobs and
    values outside a knob's values are errors; infeasible points (``fam.valid``) are dropped."""
    knobs = {k.name: k for k in fam.knobs}

    def check(name: str, values: Sequence[Any]) -> None:
        if name not in knobs:
            raise SweepError(f"{fam.name} has no knob {name!r}; knobs: {', '.join(knobs)}")
        bad = [v for v in values if v not in knobs[name].values]
        if bad:
            raise SweepError(f"{fam.name}.{name} takes {list(knobs[name].values)}, not {bad}")

    if points:
        raw = [dict(p) for p in points]
        for p in raw:
            for name, v in p.items():
                check(name, [v])
    else:
        grid = dict(grid or {})
        for name, values in grid.items():
            if not values:
                raise SweepError(f"agents.sweep.grid.{name} is empty")
            check(name, list(values))
        names = list(grid)
        raw = [dict(zip(names, combo, strict=True)) for combo in itertools.product(*(grid[n] for n in names))]
    out: list[dict[str, Any]] = []
    seen: set[tuple] = set()
    for p in raw:
        point = {**fam.start, **p}
        if not fam.valid(point):
            continue
        key = tuple(sorted((k, repr(v)) for k, v in point.items()))
        if key not in seen:
            seen.add(key)
            out.append(point)
    return out


class SweepAgent:
    """Proposes its share of a sweep's points, in order; never adapts to verdicts."""

    def __init__(self, name: str, fam: Family, points: list[dict[str, Any]], strategy: str):
        self.name = name
        self.strategy = strategy
        self.family = fam
        self._queue = list(points)

    def propose(self, ctx: AgentContext, n: int) -> Proposal:
        out: list[Candidate] = []
        while self._queue and len(out) < n:
            point = self._queue.pop(0)
            cand = Candidate(
                source=self.family.render(point),
                language=self.family.language,
                agent=self.name,
                strategy=self.strategy,
                family=self.family.name,
                knobs=point,
                rationale=f"sweep of {self.family.name}: {_diff(self.family.start, point)}"[:300],
            )
            if cand.id not in ctx.seen:
                out.append(cand)
        return Proposal(out)

    def observe(self, candidate: Candidate, verdict: Verdict) -> str | None:
        what = f"{candidate.family} {_diff(self.family.start, candidate.knobs)}"
        if verdict.status is Status.champion:
            return f"{what}: champion"[:200]
        if verdict.correct:
            s = verdict.speedup_vs_champion
            return f"{what}: correct, {s:.2f}x the champion" if s else f"{what}: correct, slower"
        return f"{what}: {verdict.status.value}"[:200]


def _diff(start: Mapping[str, Any], point: Mapping[str, Any]) -> str:
    moved = [f"{k}={v}" for k, v in point.items() if start.get(k) != v]
    return ", ".join(moved) or "the start point"


def build_sweep_agents(task_name: str, count: int, family: str | None, grid, points) -> list[SweepAgent]:
    """``count`` agents sharing the sweep's points round-robin (agent i takes points i, i+count, ...)."""
    fam = find_family(task_name, family)
    pts = sweep_points(fam, grid, points)
    if not pts:
        raise SweepError(f"the sweep of {fam.name} has no feasible point")
    varied = [k for k in fam.knobs if any(p.get(k.name) != fam.start.get(k.name) for p in pts)]
    strategy = varied[0].strategy if varied else fam.knobs[0].strategy
    count = max(1, min(count, len(pts)))
    return [SweepAgent(f"agent{i}-sweep", fam, pts[i::count], strategy) for i in range(count)]
