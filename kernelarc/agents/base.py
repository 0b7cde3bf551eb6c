"""The agent contract: agents propose candidates and draw conclusions; the orchestrator
evaluates, posts findings on the board and tracks everything."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from kernelarc.models import Candidate, Finding, Status, Verdict
from kernelarc.plateau import PlateauEvent
from kernelarc.tasks.loader import Task


@dataclass
class AgentContext:
    """What an agent may see when it proposes. Built fresh by the orchestrator each round."""

    task: Task
    target: Any  # kernelarc.hardware.GpuTarget
    champion: Candidate | None  # current champion (None before the first correct candidate)
    champion_verdict: Verdict | None
    # the board (kernelarc.board.Entry findings): the best wins, then the newest traps, each bounded by
    # memory.limit (0: empty, k: k of each, None: all)
    findings: list[Finding]
    history: list[tuple[Candidate, Verdict]]  # this agent's own attempts with their verdicts, oldest first
    seen: frozenset[str]  # ids of every candidate already proposed in this session (dedupe)
    redirect: str | None = None  # plateau breaker's instruction (text, for LLM agents); only to redirected agents
    plateau: PlateauEvent | None = None  # the same firing, typed (its action and target family)
    backups: list[tuple[Candidate, Verdict]] = field(default_factory=list)  # correct but slower candidates
    budget_left: int | None = None  # candidates left in the session budget
    # the baselines judged so far (label -> status: "reference", "torch.compile"); a torch.compile that is
    # incorrect says Inductor's numerics leave the problem's tolerance, compiled compositions included
    baselines: dict[str, Status] = field(default_factory=dict)
    # the read-only leaderboard (kernelarc.board.Board.leaderboard): each agent's fastest correct kernel, shown
    # whatever memory.limit is (the siblings' bests; the findings above are what memory adds around them)
    leaders: list[Finding] = field(default_factory=list)


@dataclass
class Proposal:
    """An agent's answer for one round."""

    candidates: list[Candidate]
    # One-line conclusions about earlier attempts: (candidate_id, lesson). The orchestrator posts
    # them on the board as Findings; an agent that has nothing to conclude returns [].
    conclusions: list[tuple[str, str]] = field(default_factory=list)
    cost: dict[str, float] = field(default_factory=dict)  # e.g. input_tokens, output_tokens, usd
    failures: list[str] = field(default_factory=list)  # recorded problems (malformed reply, API outage)


class Agent(Protocol):
    name: str  # unique in a session, e.g. "agent0-tiling"
    strategy: str  # one of kernelarc.families.STRATEGIES
    # Optional (default False): True for an agent that must not be asked again while a candidate of its own
    # waits for its verdict (LLM agents: their conclusion about it comes with their next proposal). Others
    # are asked whenever an evaluation slot is free and it is their turn (kernelarc.allot).
    # waits_for_verdicts: bool

    def propose(self, ctx: AgentContext, n: int) -> Proposal:
        """Up to ``n`` new candidates (ids not in ctx.seen)."""
        ...

    def observe(self, candidate: Candidate, verdict: Verdict) -> str | None:
        """Called with the verdict of each of this agent's candidates. May return a one-line
        lesson right away (offline agents do); LLM agents return None and put their conclusion
        into the next Proposal.conclusions."""
        ...
