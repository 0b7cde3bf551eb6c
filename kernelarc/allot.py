"""Proposals sized to the free evaluation slots: who proposes how many candidates, now.

The session asks its agents for candidates only when an evaluation slot is free, and only for as many
as can start at once (free slots, capped by the budget left), shared fairly among the agents. So every
proposal is made with the freshest board, verdicts and champion there can be: a candidate that would
wait in a queue behind others was proposed before their verdicts, i.e. blind to them. On the simulated
model (issue 16) this staleness, not the team's size, drove the results: a lone agent proposing a batch
of ``agents.per_round`` x 4 waited for verdicts it could have used.

The share: one slot at a time to the agent that is first by, in order,

1. the plateau breaker's redirected agent (it was told to change course: its proposal should not wait);
2. the fewest candidates of its own still queued or in flight (an idle agent has all its own results,
   and a team keeps one line of search per member in flight before any member gets two);
3. the fewest candidates queued so far this session, over the agent's ``weight`` (each agent gets its
   share of the budget; with ``agents.credit``, the share follows the agent's win rate, see :func:`credit`
   and :func:`frontier_wins`:
   strategies that earn their keep get more of the budget, and none is starved);
4. team order.

``cap`` (``agents.per_round``) is the most one agent proposes in one request: an upper bound, not the
batch size (LLM agents make one request per call to ``propose`` with up to ``cap`` kernels). With more
free slots than ``cap`` x agents, the session simply asks again once the first candidates have started.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kernelarc.models import Status


def allot(
    agents: Sequence[str],
    free: int,
    cap: int,
    *,
    busy: Mapping[str, int] | None = None,
    queued: Mapping[str, int] | None = None,
    first: Sequence[str] = (),
    weight: Mapping[str, float] | None = None,
) -> dict[str, int]:
    """How many candidates each agent (by name, in team order) proposes now for ``free`` slots; agents
    asked for none are left out. ``busy``: each agent's candidates queued or in flight; ``queued``: its
    candidates queued so far; ``first``: agents to serve before the others (a plateau redirect); ``weight``:
    each agent's share of the budget, relative (default 1 each)."""
    if cap < 1:
        raise ValueError(f"cap (agents.per_round) must be at least 1, not {cap}")
    if len(set(agents)) != len(agents):
        raise ValueError(f"agent names must be unique: {list(agents)}")
    busy, queued, weight = busy or {}, queued or {}, weight or {}
    if any(not w > 0 for w in weight.values()):
        raise ValueError(f"weights must be positive: {dict(weight)}")
    rank = {a: i for i, a in enumerate(agents)}
    lead = set(first)
    out: dict[str, int] = {}
    for _ in range(max(0, free)):
        open_ = [a for a in agents if out.get(a, 0) < cap]
        if not open_:
            break

        def key(a: str) -> tuple:
            given = out.get(a, 0)
            share = (queued.get(a, 0) + given) / weight.get(a, 1.0)
            return (a not in lead or given > 0, busy.get(a, 0) + given, share, rank[a])

        pick = min(open_, key=key)
        out[pick] = out.get(pick, 0) + 1
    return {a: out[a] for a in agents if a in out}


def frontier_wins(judged: Sequence[tuple[Any, Any]], margin: float = 0.01) -> set[str]:
    """Ids of the judged (candidate, verdict) pairs, in judgment order, that earned their keep: promoted over
    the champion, or a family kernel faster by ``margin`` than every family kernel judged before it (while
    the library leads, that is the search's progress). A family's first or best kernel far behind that
    frontier is no win: it spent a slot and moved nothing."""
    best = math.inf
    out: set[str] = set()
    for c, v in judged:
        lat = v.latency_ms if v.correct else None
        if v.status is Status.champion or (c.family and lat and lat * (1 + margin) < best):
            out.add(c.id)
        if c.family and lat and math.isfinite(lat):
            best = min(best, lat)
    return out


def credit(history: Mapping[str, Sequence[tuple[Any, Any]]], is_win: Callable[[str], bool]) -> dict[str, float]:
    """Each agent's win rate so far, smoothed: (wins + 1) / (judged + 2), where ``history`` maps an agent to
    its judged (candidate, verdict) pairs and ``is_win`` says whether a candidate id earned its keep
    (:func:`frontier_wins`). Before any verdict every agent weighs 1/2: equal shares."""
    return {a: (sum(bool(is_win(c.id)) for c, _ in h) + 1) / (len(h) + 2) for a, h in history.items()}
