"""Offline strategy agents: local search over parameterized kernel families, guided by the board.

Each agent owns a strategy; the strategy decides which knobs it moves (each Knob names
its owning strategy) and, for ``algorithmic``, which family it switches to. Agents start
from the champion when it comes from a family (so they build on what worked), read the
board to prefer knob values that gained and avoid ones that failed, never repeat a
candidate the session has seen, and explain each proposal in one line.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from kernelarc.agents.base import AgentContext, Proposal
from kernelarc.agents.surrogate import Surrogate, repair
from kernelarc.families import Family, Knob, families_for
from kernelarc.models import Candidate, Finding, Status, Verdict
from kernelarc.tasks.loader import Task

FAILED = (Status.compile_error, Status.runtime_error, Status.timeout, Status.incorrect, Status.rejected_hack)


def generic_families(task: Task) -> list[Family]:
    """For any task: the reference under torch.compile with different settings (``pytorch`` candidates)."""
    ref = task.definition.reference

    def render(k: Mapping[str, Any]) -> str:
        header = "import torch\n" if "import torch" not in ref else ""
        lines = [header + ref, "", "# --- kernelarc generic variant ---", "_kernelarc_reference_run = run"]
        if k["matmul_precision"] != "highest":
            lines.append(f"torch.set_float32_matmul_precision({k['matmul_precision']!r})")
        if k["mode"] == "eager":
            lines.append("_kernelarc_fn = _kernelarc_reference_run")
        else:
            mode = "None" if k["mode"] == "default" else repr(k["mode"])
            lines.append(
                f"_kernelarc_fn = torch.compile(_kernelarc_reference_run, mode={mode}, dynamic={k['dynamic']})"
            )
        lines += ["", "", "def run(*args):", "    return _kernelarc_fn(*args)", ""]
        return "\n".join(lines)

    knobs = (
        Knob("mode", ("eager", "default", "max-autotune-no-cudagraphs"), "scheduling", "torch.compile mode"),
        Knob("dynamic", (False, True), "algorithmic", "dynamic-shape compilation"),
        Knob("matmul_precision", ("highest", "high"), "precision", "fp32 matmuls on TF32 tensor cores"),
    )
    fam = Family(
        name="pytorch.compile_variants",
        task=task.name,
        description="the reference under torch.compile with different modes and precision",
        knobs=knobs,
        start={"mode": "default", "dynamic": False, "matmul_precision": "highest"},
        render=render,
        language="pytorch",
    )
    return [fam]


def _knob_diff(a: Mapping[str, Any] | None, b: Mapping[str, Any]) -> str:
    if not a:
        return ", ".join(f"{k}={v}" for k, v in b.items())
    parts = [f"{k} {a.get(k)}→{v}" for k, v in b.items() if a.get(k) != v]
    return ", ".join(parts) or "same knobs"


class SearchAgent:
    """One offline agent with one strategy."""

    def __init__(self, name: str, strategy: str, task: Task, seed: int = 0, families: list[Family] | None = None):
        self.name = name
        self.strategy = strategy
        self.task = task
        self.rng = random.Random(f"{seed}:{name}")
        fams = families if families is not None else families_for(task.name)
        self.families = {f.name: f for f in fams}
        for f in generic_families(task):
            self.families.setdefault(f.name, f)
        self._parents: dict[str, tuple[str | None, dict[str, Any] | None]] = {}
        self._score: dict[str, float] = {}  # candidate id -> speed relative to the champion it was timed with
        self._momentum: list[tuple[str, dict[str, Any], list[tuple[str, Any, Any]], float]] = []
        self.extra_families: dict[str, Family] = {}

    # -- board statistics -------------------------------------------------------------
    @staticmethod
    def _stats(findings: list[Finding]) -> tuple[dict, dict]:
        gains: dict[tuple[str, str, Any], list[float]] = defaultdict(list)
        fails: dict[tuple[str, str, Any], int] = defaultdict(int)
        for f in findings:
            if not f.family:
                continue
            for k, v in f.knobs.items():
                key = (f.family, k, repr(v))
                if f.status in FAILED:
                    fails[key] += 1
                elif f.gain is not None:
                    gains[key].append(f.gain)
        return gains, fails

    # -- proposing ---------------------------------------------------------------------
    def _owned(self, fam: Family) -> list[Knob]:
        return [k for k in fam.knobs if k.strategy == self.strategy]

    def _base(self, ctx: AgentContext) -> tuple[Family, dict[str, Any], str | None, str]:
        fams = list(self.families.values())
        redirect = ctx.redirect or ""
        champ = ctx.champion
        if redirect.startswith("branch") and ctx.backups:
            pool = [(c, v) for c, v in ctx.backups if c.family in self.families]
            if pool:
                c, _ = min(pool, key=lambda cv: cv[1].latency_ms or math.inf)
                return self.families[c.family], dict(c.knobs), c.id, "branching from backup"
        if redirect.startswith("explore") or (self.strategy == "algorithmic" and self.rng.random() < 0.5):
            others = [f for f in fams if not champ or f.name != champ.family]
            if others:
                fam = self.rng.choice(others)
                # a family already tried but not the champion: half the time, step from its own best point,
                # so a design whose start point is slow still gets climbed (not only restarted or ported onto)
                known = self._known(ctx)
                own = [k for k in known if k[1].name == fam.name]
                if own and self.rng.random() < 0.5:
                    _, _, point, cid, _ = own[0]
                    return fam, point, cid, f"climbing {fam.name} from its best point"
                # the best family point so far (the champion when it is one) carried over to this family
                src = [(champ.family, champ.knobs)] if champ is not None and champ.family in self.families else []
                src += [(k[1].name, k[2]) for k in known]
                src = [(f, kn) for f, kn in src if self.families[f].language != "pytorch"][:1]
                ported = self._port(fam, *src[0]) if src else None
                if ported is not None and self.rng.random() < 0.75:
                    return fam, ported, None, f"porting the best {src[0][0]} point to {fam.name}"
                point = dict(fam.start) if self.rng.random() < 0.5 else self._random_point(fam)
                return fam, point, None, f"exploring family {fam.name}"
        if champ is not None and champ.family in self.families and champ.knobs:
            return self.families[champ.family], dict(champ.knobs), champ.id, "from the champion"
        # Champion is not a family kernel: build on the best family point known, from this agent's own
        # attempts and from the board (bounded by memory.limit), or start a family nobody has tried.
        tried = {c.family for c, _ in ctx.history} | {f.family for f in ctx.findings if f.family}
        untried = [f for f in fams if f.name not in tried and f.language != "pytorch"]
        known = self._known(ctx)
        if untried and (not known or self.rng.random() < 0.3):
            fam = untried[self.rng.randrange(len(untried))]
            src = [k for k in known if k[1].language != "pytorch"][:1]
            ported = self._port(fam, src[0][1].name, src[0][2]) if src else None
            if ported is not None and self.rng.random() < 0.5:
                return fam, ported, None, f"starting family {fam.name} at the best {src[0][1].name} point"
            return fam, dict(fam.start), None, f"starting family {fam.name}"
        if known:
            pick = known[0] if self.rng.random() < 0.75 else self.rng.choice(known[:4])
            _, fam, point, cid, why = pick
            return fam, point, cid, why
        fam = self.rng.choice(fams)
        return fam, dict(fam.start), None, f"starting family {fam.name}"

    def _known(self, ctx: AgentContext) -> list[tuple[float, Family, dict[str, Any], str, str]]:
        """Correct family points from this agent's attempts and the board, fastest first."""
        known: list[tuple[float, Family, dict[str, Any], str, str]] = []
        for c, v in ctx.history:
            if v.correct and c.family in self.families and c.knobs:
                known.append(
                    (v.speedup_vs_champion or 0.0, self.families[c.family], dict(c.knobs), c.id, "from my best point")
                )
        for f in ctx.findings:
            if f.status in (Status.champion, Status.correct_slower) and f.family in self.families and f.knobs:
                known.append((1.0 + (f.gain or -1.0), self.families[f.family], dict(f.knobs), f.candidate_id,
                              f"from the board's best point ({f.agent})"))  # fmt: skip
        known.sort(key=lambda k: k[0], reverse=True)
        return known

    def _port(self, fam: Family, src_family: str | None, src_knobs: Mapping[str, Any]) -> dict[str, Any] | None:
        """A point's values for the knobs this family shares with it (tile sizes, warps, stages), the
        family's own start for the rest, made feasible; None when nothing carries over."""
        if not src_knobs or src_family == fam.name or fam.language == "pytorch":
            return None
        names = {k.name for k in fam.knobs}
        shared = {n: v for n, v in src_knobs.items() if n in names and v in fam.knob(n).values}
        if not shared:
            return None
        return repair(fam, {**fam.start, **shared}, shared, self.rng)

    def _random_point(self, fam: Family) -> dict[str, Any]:
        for _ in range(50):
            p = {k.name: self.rng.choice(k.values) for k in fam.knobs}
            if fam.valid(p):
                return p
        return dict(fam.start)

    def _mutate(self, fam: Family, point: dict[str, Any], gains: dict, fails: dict) -> tuple[dict[str, Any], str]:
        owned = self._owned(fam) or list(fam.knobs)
        steps = 1 if self.rng.random() < 0.7 else 2
        new = dict(point)
        notes = []
        for knob in self.rng.sample(owned, k=min(steps, len(owned))):
            cur = new.get(knob.name, fam.start.get(knob.name))
            idx = knob.values.index(cur) if cur in knob.values else 0
            if self.rng.random() < 0.25:
                # A long jump: any value of the knob (large design changes are often where the gains are).
                options = [v for v in knob.values if v != cur] or list(knob.values)
            else:
                options = [v for j, v in enumerate(knob.values) if 0 < abs(j - idx) <= 2] or list(knob.values)
            weights = []
            for v in options:
                key = (fam.name, knob.name, repr(v))
                g = gains.get(key)
                w = math.exp(max(min(sum(g) / len(g), 2.0), -2.0) * 2) if g else 1.0
                w /= 1 + 3 * fails.get(key, 0)
                weights.append(w)
            v = self.rng.choices(options, weights=weights)[0]
            new[knob.name] = v
            hint = ""
            key = (fam.name, knob.name, repr(v))
            if key in gains:
                hint = f" (board: {sum(gains[key]) / len(gains[key]):+.0%} with it)"
            notes.append(f"{knob.name} {cur}→{v}{hint}")
        moved = [k.name for k in owned if new.get(k.name) != point.get(k.name)]
        if not fam.valid(new):
            fixed = repair(fam, new, moved, self.rng)
            if fixed is not None:
                follow = [f"{k} {new.get(k)}→{v}" for k, v in fixed.items() if new.get(k) != v]
                notes.append("to stay feasible " + ", ".join(follow))
                new = fixed
        return new, "; ".join(notes)

    def _surrogate(self, fam: Family, ctx: AgentContext, cache: dict[str, Surrogate]) -> Surrogate:
        """Model of this family's speed from the board and this agent's own verdicts (see surrogate.py)."""
        if fam.name not in cache:
            obs: list[tuple[dict[str, Any], float]] = []
            for f in ctx.findings:
                if f.family == fam.name and f.gain is not None and f.knobs:
                    obs.append((f.knobs, 1.0 + f.gain))
            for c, v in ctx.history:
                if c.family == fam.name and v.correct and v.speedup_vs_champion:
                    obs.append((c.knobs, v.speedup_vs_champion))
            cache[fam.name] = Surrogate(fam, obs)
        return cache[fam.name]

    def _best_move(
        self, fam: Family, base: dict[str, Any], gains: dict, fails: dict, model: Surrogate, seen: set[str], k: int = 6
    ) -> tuple[dict[str, Any], str]:
        """Draw ``k`` local moves and keep the one the surrogate ranks highest (the first when it has too
        little data)."""
        moves: list[tuple[dict[str, Any], str]] = []
        keys = set()
        for _ in range(3 * k):
            point, note = self._mutate(fam, base, gains, fails)
            key = tuple(sorted((n, repr(v)) for n, v in point.items()))
            if key in keys or not fam.valid(point) or self._render_id(fam, point) in seen:
                continue
            keys.add(key)
            moves.append((point, note))
            if len(moves) >= k:
                break
        if not moves:
            return self._mutate(fam, base, gains, fails)
        if not model.ready or len(moves) == 1:
            return moves[0]
        scored = [(model.score(p), i) for i, (p, _) in enumerate(moves)]
        best = max(scored)[1]
        point, note = moves[best]
        return point, f"{note} (model's pick of {len(moves)} moves, fitted on {model.n} points)"

    def _continue(self, seen: set[str]) -> Candidate | None:
        """Line search: repeat the last step that gained, one more notch in the same direction."""
        while self._momentum:
            fam_name, point, moves, gain = self._momentum.pop()
            fam = self.families.get(fam_name)
            if fam is None:
                continue
            new = dict(point)
            notes = []
            for name, old, cur in moves:
                vals = fam.knob(name).values
                if old not in vals or cur not in vals:
                    continue
                i_old, i_cur = vals.index(old), vals.index(cur)
                step = (i_cur > i_old) - (i_cur < i_old)
                j = i_cur + step
                if step and 0 <= j < len(vals):
                    new[name] = vals[j]
                    notes.append(f"{name} {cur}→{vals[j]}")
            if not notes or not fam.valid(new):
                continue
            new = fam.check_point(new)
            note = f"continuing the step that gained {gain:+.0%}: " + ", ".join(notes)
            rationale = f"{self.strategy}: {fam.name} {note}"[:300]
            cand = Candidate(source=fam.render(new), language=fam.language, agent=self.name, strategy=self.strategy,
                             family=fam.name, knobs=new, rationale=rationale)  # fmt: skip
            if cand.id not in seen:
                return cand
        return None

    def propose(self, ctx: AgentContext, n: int) -> Proposal:
        gains, fails = self._stats(ctx.findings)
        for f in ctx.findings:
            if f.gain is not None:
                self._score.setdefault(f.candidate_id, 1.0 + f.gain)
        out: list[Candidate] = []
        seen = set(ctx.seen)
        models: dict[str, Surrogate] = {}
        for _ in range(n):
            cand = self._continue(seen) if self.rng.random() < 0.7 else None
            if cand is not None:
                seen.add(cand.id)
                self._parents[cand.id] = (None, None)
                out.append(cand)
                continue
            for _attempt in range(60):
                fam, base, parent, why = self._base(ctx)
                if parent is None and fam.name != (ctx.champion.family if ctx.champion else None):
                    point, note = base, why
                    if self._render_id(fam, point) in seen:
                        point, note = self._mutate(fam, base, gains, fails)
                        note = f"{why}; {note}"
                else:
                    point, note = self._best_move(fam, base, gains, fails, self._surrogate(fam, ctx, models), seen)
                    note = f"{why}: {note}"
                try:
                    point = fam.check_point(point)
                except ValueError:
                    continue
                if not fam.valid(point):
                    continue
                src = fam.render(point)
                cand = Candidate(
                    source=src,
                    language=fam.language,
                    agent=self.name,
                    strategy=self.strategy,
                    family=fam.name,
                    knobs=point,
                    parent=parent,
                    rationale=f"{self.strategy}: {fam.name} {note}"[:300],
                )
                if cand.id in seen:
                    continue
                seen.add(cand.id)
                self._parents[cand.id] = (parent, base if parent else None)
                out.append(cand)
                break
        return Proposal(out)

    @staticmethod
    def _render_id(fam: Family, point: dict[str, Any]) -> str:
        try:
            return Candidate(source=fam.render(fam.check_point(point)), language=fam.language).id
        except Exception:  # noqa: BLE001
            return ""

    def observe(self, candidate: Candidate, verdict: Verdict) -> str | None:
        _parent, base = self._parents.pop(candidate.id, (None, None))
        score = verdict.speedup_vs_champion if verdict.correct else None
        if score is not None and math.isfinite(score):
            self._score[candidate.id] = score
            parent_score = self._score.get(_parent) if _parent else None
            if base and parent_score and score > parent_score * 1.02 and candidate.family:
                moves = [(k, base.get(k), v) for k, v in candidate.knobs.items() if base.get(k) != v]
                self._momentum.append((candidate.family, dict(candidate.knobs), moves, score / parent_score - 1))
                self._momentum = self._momentum[-4:]
        what = f"{candidate.family or 'kernel'} {_knob_diff(base, candidate.knobs)}"
        if verdict.status is Status.champion:
            s = verdict.speedup_vs_champion
            gain = f"{s:.2f}x over the previous champion" if s and math.isfinite(s) else "first correct kernel"
            return f"{what}: new champion, {gain}"[:200]
        if verdict.status is Status.correct_slower:
            s = verdict.speedup_vs_champion
            rel = f"{s:.2f}x the champion's speed" if s and math.isfinite(s) else "not faster"
            return f"{what}: correct but {rel}"[:200]
        err = (verdict.errors[0] if verdict.errors else "").strip().splitlines()
        first = next((ln for ln in reversed(err) if ln.strip()), "") if err else ""
        return f"{what}: {verdict.status.value} ({first[:120]})"[:200]
