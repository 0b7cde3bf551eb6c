"""Hybrid proposals: tune the knobs that an LLM-written kernel declares.

An LLM kernel may declare a module-level ``KNOBS = {"BLOCK": [64, 128], ...}`` literal and
read its constants from module-level UPPER_CASE assignments. This offline agent takes the
best such kernel seen so far (champion first, then backups) and moves one knob at a time,
so the language model invents structure and the search finds its best point.
"""

from __future__ import annotations

import random

from kernelarc.agents.base import AgentContext, Proposal
from kernelarc.models import Candidate, Verdict


class KnobTuner:
    def __init__(self, name: str, strategy: str, task, seed: int = 0):
        self.name = name
        self.strategy = strategy
        self.task = task
        self.rng = random.Random(f"{seed}:{name}")

    def propose(self, ctx: AgentContext, n: int) -> Proposal:
        from kernelarc.agents.llm import knob_space_of, render_with_knobs

        bases = ([(ctx.champion, ctx.champion_verdict)] if ctx.champion else []) + list(ctx.backups)
        out: list[Candidate] = []
        seen = set(ctx.seen)
        for base, _v in bases:
            if base is None or base.family is not None or base.language != "triton":
                continue
            try:
                space = knob_space_of(base)
            except Exception:  # noqa: BLE001 - a kernel without a knob literal is simply not tunable
                continue
            if not space:
                continue
            for _ in range(20 * n):
                if len(out) >= n:
                    break
                knob = self.rng.choice(sorted(space))
                values = list(space[knob])
                cur = base.knobs.get(knob)
                idx = values.index(cur) if cur in values else 0
                options = [v for j, v in enumerate(values) if 0 < abs(j - idx) <= 1] or values
                value = self.rng.choice(options)
                point = {**base.knobs, knob: value}
                try:
                    src = render_with_knobs(base.source, point)
                except Exception:  # noqa: BLE001
                    break
                cand = Candidate(source=src, language=base.language, agent=self.name, strategy=self.strategy,
                                 knobs=point, parent=base.id,
                                 rationale=f"tuning LLM kernel {base.id}: {knob} {cur}→{value}")  # fmt: skip
                if cand.id not in seen:
                    seen.add(cand.id)
                    out.append(cand)
            if len(out) >= n:
                break
        return Proposal(out)

    def observe(self, candidate: Candidate, verdict: Verdict) -> str | None:
        return f"knob tuning {candidate.rationale.split(': ', 1)[-1]}: {verdict.status.value}"[:200]
