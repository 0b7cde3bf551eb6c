"""Offline strategy agents: operators over parameterized kernel families, guided by the board.

Each agent's strategy is an *operator* (``Operator``), free to move any knob its move needs:

* ``exploit``: surrogate-ranked local moves (one or two knobs, repaired through the coupled ones)
  around the best known point, plus line search along a step that gained;
* ``explore``: a family nobody has measured, or another family climbed from its own best point
  for as long as it keeps improving (an island);
* ``transplant``: a win's knob values ported to another family by knob name;
* ``focus`` (the knob-class strategies: tiling, memory, precision, fusion, scheduling,
  algorithmic): local moves led by a knob of that class, plus any other knob a coupled move needs.

A single agent is the ``generalist``: each proposal draws its operator from ``GENERALIST_MIX`` (the
shares a default team spends on each). Agents read the board: they build on the wins' points,
transplant them, avoid the trap knob values (and, more weakly, the same value of a knob of the same
name in other families), never repeat a candidate the session has seen, and explain each proposal
in one line. A plateau redirect (``AgentContext.plateau``) takes the agent's first candidate.
"""

from __future__ import annotations

import math
import random
import re
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kernelarc.agents.base import AgentContext, Proposal
from kernelarc.agents.surrogate import Surrogate, repair
from kernelarc.board import RECORD_MARGIN, Kind
from kernelarc.families import STRATEGIES, Family, Knob, families_for
from kernelarc.models import Candidate, Finding, Status, Verdict
from kernelarc.tasks.loader import Task

# two points whose latencies differ by less than this (log, ~2%) timed alike: within timing noise and
# below the guard's promotion margin, so neither would ever be promoted over the other
FLAT_LOG = 0.02
FAILED = (Status.compile_error, Status.runtime_error, Status.timeout, Status.incorrect, Status.rejected_hack)


GENERIC_FAMILY = "pytorch.compile_variants"


def generic_families(task: Task) -> list[Family]:
    """For any task: the reference under torch.compile with different settings (``pytorch`` candidates)."""
    from kernelarc.graph.compose import drop_main_guard

    # without the reference's `if __name__ == "__main__":` demo: dead code in an imported candidate, whose
    # "__main__" literal the guard's static check rejects (Quant/003 and Quant/014's references carry one)
    ref = drop_main_guard(task.definition.reference)

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
        name=GENERIC_FAMILY,
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


class Operator(StrEnum):
    """What an offline agent does with a proposal. Every operator may move any knob its move needs."""

    exploit = "exploit"  # surrogate-ranked local moves (any knob, coupled pairs) around the best point
    explore = "explore"  # untried families, or another family climbed from its own best point
    transplant = "transplant"  # a win's knob values ported to another family
    focus = "focus"  # local moves led by one knob class (tiling, memory, precision, fusion, ...)


# Strategy names only the offline agents know (LLM agents take the knob-class strategies, which have briefs).
OPERATOR_STRATEGIES = ("exploit", "explore", "transplant", "generalist")
# The generalist's mix: the shares a default four-agent team spends on each operator, so a single agent
# differs from the team only in being one agent (one history, one line of search), not in what it can do.
GENERALIST_MIX = (
    (Operator.exploit, 0.25),
    (Operator.explore, 0.25),
    (Operator.transplant, 0.25),
    (Operator.focus, 0.25),
)


def knob_classes(task_name: str) -> list[str]:
    """The knob classes (STRATEGIES) that own a knob of the task's families, in STRATEGIES order."""
    owned = {k.strategy for f in families_for(task_name) for k in f.knobs}
    return [s for s in STRATEGIES if s in owned]


def offline_team(names: list[str], count: int, task_name: str) -> list[str]:
    """The strategies of ``count`` offline agents: the operators named first (exploit, explore,
    transplant), then the knob classes that own a knob of the task's families, then the rest, in the
    user's order, round robin. One agent given several strategies is the generalist (it mixes them)."""
    if count < 1:
        raise ValueError("agents.count must be at least 1")
    if count == 1 and len(names) > 1:
        return ["generalist"]
    owned = set(knob_classes(task_name))
    if len(families_for(task_name)) > 1:
        owned.add("algorithmic")
    ops = [n for n in names if n in OPERATOR_STRATEGIES and n != "generalist"]
    rel = [n for n in names if n not in OPERATOR_STRATEGIES and n in owned]
    rest = [n for n in names if n not in ops and n not in rel]
    order = ops + rel + rest or ["generalist"]
    return [order[i % len(order)] for i in range(count)]


@dataclass
class _Info:
    """What one proposal round knows: board statistics and the known correct points."""

    gains: dict[tuple[str, str, str], list[float]]
    fails: dict[tuple[str, str, str], float]
    known: list[tuple[float, Family, dict[str, Any], str, str]]  # (latency, family, knobs, id, why), fastest first
    wins: list[tuple[Family, dict[str, Any], str]]  # (family, knobs, id) of the wins, best first
    tried: dict[str, int]  # family -> candidates seen (own history and board)
    sens: dict[str, dict[str, float]] = field(default_factory=dict)  # family -> knob -> how much it mattered
    # paired evidence: measured points of one family that differ in a single knob. ``flat``: the value pairs
    # of a knob that timed alike; ``steep``: how many pairs of the knob did not (see ``pair_evidence``)
    flat: dict[tuple[str, str], set[frozenset[str]]] = field(default_factory=lambda: defaultdict(set))
    steep: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))
    flat_n: dict[tuple[str, str], int] = field(default_factory=lambda: defaultdict(int))  # flat point pairs
    # the value pairs of a knob that did NOT time alike somewhere: such a pair is not equivalent, whatever
    # other points showed (a knob's effect depends on the others: more findings can refute an equivalence)
    refuted: dict[tuple[str, str], set[frozenset[str]]] = field(default_factory=lambda: defaultdict(set))
    by_family: dict[str, list[dict[str, Any]]] = field(default_factory=lambda: defaultdict(list))

    def pair_evidence(self, same: float = FLAT_LOG) -> None:
        """Compare every two measured points of a family that differ in exactly one knob: the knob's two
        values timed alike (within ``same`` log-latency) or not. Unlike group means (``sensitivity``),
        a pair is not confounded by the other knobs, so it is the evidence for calling two points
        equivalent (``near_duplicate``)."""
        pts: dict[str, dict[str, tuple[dict[str, Any], float]]] = defaultdict(dict)
        for lat, fam, knobs, cid, _ in self.known:
            if lat and lat > 0 and math.isfinite(lat):
                pts[fam.name].setdefault(cid, (knobs, math.log(lat)))
        for fam_name, by_id in pts.items():
            rows = list(by_id.values())
            self.by_family[fam_name] = [k for k, _ in rows]
            for i, (a, la) in enumerate(rows):
                for b, lb in rows[i + 1 :]:
                    diff = [n for n in set(a) | set(b) if a.get(n) != b.get(n)]
                    if len(diff) != 1:
                        continue
                    key = (fam_name, diff[0])
                    pair = frozenset((repr(a.get(diff[0])), repr(b.get(diff[0]))))
                    if abs(la - lb) < same:
                        self.flat[key].add(pair)
                        self.flat_n[key] += 1
                    else:
                        self.steep[key] += 1
                        self.refuted[key].add(pair)
        for key, pairs in self.flat.items():
            pairs -= self.refuted.get(key, set())

    def inert(self, family: str, knob: str, pairs: int = 2) -> bool:
        """No measured effect: at least ``pairs`` single-knob pairs of it timed alike and none did not."""
        key = (family, knob)
        return self.steep.get(key, 0) == 0 and self.flat_n.get(key, 0) >= pairs

    def equivalent(self, family: str, knob: str, a: Any, b: Any) -> bool:
        """Values ``a`` and ``b`` of the knob time alike: equal, the knob is inert, or a chain of flat
        pairs joins them (4~8 and 8~16 make 4~16), none of which timed apart anywhere else, and the pair
        itself never timed apart."""
        if a == b or self.inert(family, knob):
            return True
        pairs = self.flat.get((family, knob))
        if not pairs or frozenset((repr(a), repr(b))) in self.refuted.get((family, knob), ()):
            return False
        reach, todo, goal = {repr(a)}, [repr(a)], repr(b)
        while todo:
            v = todo.pop()
            for pair in pairs:
                if v in pair:
                    for w in pair - reach:
                        if w == goal:
                            return True
                        reach.add(w)
                        todo.append(w)
        return False

    def near_duplicate(self, family: str, point: Mapping[str, Any]) -> bool:
        """A measured point of the family differs from ``point`` only in knobs the evidence calls
        equivalent there: timing it again would only time the same kernel speed again."""
        for known in self.by_family.get(family, ()):
            if all(self.equivalent(family, n, known.get(n), point.get(n)) for n in set(known) | set(point)):
                return True
        return False

    def value_effects(self) -> None:
        """``gains[(family, knob, value)]``: log-speed of the measured points with that value over their
        family's mean (positive: the value went with faster kernels). Measured against the family, not
        the champion, so while the library leads every value is not simply "slower"."""
        by_fam: dict[str, dict[str, tuple[dict[str, Any], float]]] = defaultdict(dict)
        for lat, fam, knobs, cid, _ in self.known:
            if lat and lat > 0:
                by_fam[fam.name][cid] = (knobs, -math.log(lat))
        for fam_name, pts in by_fam.items():
            if len(pts) < 3:
                continue
            mean = sum(y for _, y in pts.values()) / len(pts)
            for knobs, y in pts.values():
                for k, v in knobs.items():
                    self.gains[(fam_name, k, repr(v))].append(y - mean)

    def sensitivity(self) -> None:
        """Per family and knob: the spread of mean log-speed across the knob's measured values (0.5 for a
        knob measured at one value only: worth trying). Moves pick knobs in proportion, so knobs that
        never changed anything stop eating the budget."""
        by_fam: dict[str, dict[str, tuple[dict[str, Any], float]]] = defaultdict(dict)
        for lat, fam, knobs, cid, _ in self.known:
            if lat and lat > 0:
                by_fam[fam.name][cid] = (knobs, -math.log(lat))
        for fam_name, pts in by_fam.items():
            if len(pts) < 4:
                continue
            out: dict[str, float] = {}
            for name in {n for knobs, _ in pts.values() for n in knobs}:
                groups: dict[str, list[float]] = defaultdict(list)
                for knobs, y in pts.values():
                    groups[repr(knobs.get(name))].append(y)
                means = [sum(v) / len(v) for v in groups.values()]
                out[name] = min(max(means) - min(means), 2.0) if len(means) > 1 else 0.5
            self.sens[fam_name] = out


def _latency_of(f: Finding) -> float | None:
    cond = getattr(f, "conditions", None)
    lat = getattr(cond, "latency_ms", None) if cond is not None else None
    if lat:
        return lat
    speed = getattr(f, "speed", None)
    return 1.0 / speed if speed else None


def shared_findings(ctx: AgentContext) -> list[Finding]:
    """What the team shares with this agent: the board's view (bounded by memory.limit), then the
    leaderboard's entries (each agent's best kernel, shown whatever the memory) the view does not hold."""
    ids = {f.candidate_id for f in ctx.findings}
    return list(ctx.findings) + [f for f in ctx.leaders if f.candidate_id not in ids]


class SearchAgent:
    """One offline agent: a specialist operator, or the generalist that mixes them all."""

    def __init__(self, name: str, strategy: str, task: Task, seed: int = 0, families: list[Family] | None = None,
                 mix: tuple[tuple[Operator, float], ...] = GENERALIST_MIX, rank: int | None = None,
                 credit: bool = True, library: Mapping[str, Mapping[str, Any]] | None = None,
                 cuda: bool = True):  # fmt: skip
        from kernelarc.families.composed import CPU_PINS, start_points

        self.name = name
        self.strategy = strategy
        self.task = task
        self.rng = random.Random(f"{seed}:{name}")
        fams = families if families is not None else families_for(task)
        self.families = {f.name: f for f in fams}
        for f in generic_families(task):
            self.families.setdefault(f.name, f)
        self.mix = mix
        # strategies that earn their keep: the generalist draws each operator by its share times its win rate
        # so far (wins + 1) / (tries + 2), as a team shares its evaluation slots by each member's (agents.credit;
        # a win: promoted, or faster than every family kernel before it, see kernelarc.allot.frontier_wins)
        self.credit = credit
        self._op_of: dict[str, Operator] = {}  # candidate id -> the operator that proposed it
        self._op_stats: dict[Operator, list[int]] = {op: [0, 0] for op, _ in mix}  # operator -> [tries, wins]
        self._fam_best: dict[str, float] = {}  # "" -> the fastest family kernel this agent has seen judged
        self.classes = sorted({k.strategy for f in fams for k in f.knobs}) or list(STRATEGIES)
        self._parents: dict[str, tuple[str | None, dict[str, Any] | None]] = {}
        self._momentum: list[tuple[str, dict[str, Any], list[tuple[str, Any, Any]], float]] = []
        self._lat: dict[str, float] = {}  # candidate id -> latency (own verdicts and the board)
        self._island: str | None = None  # the family the explore operator is climbing
        self._island_best = math.inf
        self._island_stale = 0
        self._opened: set[str] = set()  # families this agent opened at their start point (transplant)
        self.extra_families: dict[str, Family] = {}
        # knobs held at one value: on the CPU (``cuda=False``) those that change nothing there (CUDA-graph replay,
        # traced kernel calls), so no slot goes to a point that runs as one already judged
        self._pins: dict[str, Any] = {} if cuda else dict(CPU_PINS)
        # A composed problem's most promising first points (kernel families, then the library family),
        # shared out across the team by rank so that a tiny budget measures them before anything else.
        # ``library``: registered champions' kernel knobs (kernelarc.registry.kernel_library)
        composed = hasattr(task, "path")
        self._seeds: list[tuple[Family, dict[str, Any]]] = start_points(task, fams, library, cuda) if composed else []
        self._seed_ids: dict[int, list[tuple[dict[str, Any], str, str]]] = {}  # _seed_variants' renders
        self._eager_only = False  # an emulated composition failed too: repairs run the rest eager
        m = re.match(r"agent(\d+)", name)
        self.rank = rank if rank is not None else int(m.group(1)) if m else 0

    # -- operators ---------------------------------------------------------------------
    def _operator(self) -> tuple[Operator, str | None]:
        """This proposal's operator and, for ``focus``, its knob class."""
        s = self.strategy
        if s == "generalist":
            ops, shares = zip(*self.mix, strict=True)
            weights = [w * self.win_rate(op) for op, w in self.mix] if self.credit else list(shares)
            op = self.rng.choices(ops, weights=weights)[0]
            return op, (self.rng.choice(self.classes) if op is Operator.focus else None)
        if s in ("exploit", "explore", "transplant"):
            return Operator(s), None
        return Operator.focus, s

    def win_rate(self, op: Operator) -> float:
        """The operator's win rate so far, smoothed: (wins + 1) / (tries + 2) (1/2 before any verdict)."""
        tries, wins = self._op_stats.get(op, [0, 0])
        return (wins + 1) / (tries + 2)

    # -- board statistics -------------------------------------------------------------
    def _info(self, ctx: AgentContext) -> _Info:
        gains: dict[tuple[str, str, str], list[float]] = defaultdict(list)
        fails: dict[tuple[str, str, str], float] = defaultdict(float)
        known: list[tuple[float, Family, dict[str, Any], str, str]] = []
        wins: list[tuple[Family, dict[str, Any], str]] = []
        tried: dict[str, int] = defaultdict(int)
        failed: list[tuple[str, dict[str, Any]]] = []  # (family, knobs) of the failed points seen
        findings = shared_findings(ctx)
        for f in findings:
            if not f.family:
                continue
            tried[f.family] += 1
            if f.status in FAILED and f.knobs:
                failed.append((f.family, dict(f.knobs)))
            fam = self.families.get(f.family)
            lat = _latency_of(f)
            if fam is not None and f.knobs and f.status.correct:
                if lat:
                    self._lat.setdefault(f.candidate_id, lat)
                    known.append((lat, fam, dict(f.knobs), f.candidate_id, f"from the board's point ({f.agent})"))
                if f.status is Status.champion or getattr(f, "kind", None) is Kind.win:
                    # promoted, or a family record (the board's win while the library leads)
                    wins.append((fam, dict(f.knobs), f.candidate_id))
        posted = {f.candidate_id for f in findings}
        for c, v in ctx.history:
            if c.id in posted:
                continue  # already counted from the board (an agent's own findings are on it too)
            if c.family:
                tried[c.family] += 1
            if v.correct and c.family in self.families and c.knobs and v.latency_ms:
                known.append((v.latency_ms, self.families[c.family], dict(c.knobs), c.id, "from my best point"))
                if v.status is Status.champion and all(w[2] != c.id for w in wins):
                    wins.append((self.families[c.family], dict(c.knobs), c.id))
            elif not v.correct and c.family and c.knobs:
                failed.append((c.family, dict(c.knobs)))
        known.sort(key=lambda k: k[0])
        self._blame(failed, known, fails)
        champ = ctx.champion
        if champ is not None and champ.family in self.families and champ.knobs:
            # the champion is a win whatever the board shows (memory.limit=0 included)
            lat = ctx.champion_verdict.latency_ms if ctx.champion_verdict else None
            known.insert(0, (lat or 0.0, self.families[champ.family], dict(champ.knobs), champ.id, "from the champion"))
            if all(w[2] != champ.id for w in wins):
                wins.insert(0, (self.families[champ.family], dict(champ.knobs), champ.id))
        info = _Info(gains, fails, known, wins, dict(tried))
        info.sensitivity()
        info.pair_evidence()
        info.value_effects()
        return info

    def _blame(self, failed: list[tuple[str, dict[str, Any]]], known: list, fails: dict) -> None:
        """``fails[(family, knob, value)]``: how strongly a value is suspected of failing. A failed point is
        blamed on the knobs in which it differs from its nearest correct point of the family (the move
        that broke it), not on every value it had: a compile error at a deep pipeline of wide K tiles
        says nothing against its tile width. With no correct point within three knobs, every value is
        suspected, weakly. Suspects are avoided more weakly wherever else the knob exists. A suspicion is
        divided by one plus the correct points that had the value: a value that keeps working is not
        condemned by a rare failure, so more findings weigh a value's failures against its successes
        instead of only piling up blame."""
        correct: dict[str, list[dict[str, Any]]] = defaultdict(list)
        worked: dict[tuple[str, str, str], int] = defaultdict(int)
        for _, fam, knobs, _, _ in known:
            correct[fam.name].append(knobs)
            for k, v in knobs.items():
                worked[(fam.name, k, repr(v))] += 1
        raw: dict[tuple[str, str, str], float] = defaultdict(float)
        for fam_name, knobs in failed:
            best: list[str] | None = None
            for ok in correct.get(fam_name, ()):
                diff = [n for n in knobs if ok.get(n) != knobs[n]]
                if diff and (best is None or len(diff) < len(best)):
                    best = diff
            suspects, weight = (best, 1.0) if best is not None and len(best) <= 3 else (list(knobs), 0.3)
            for k in suspects:
                raw[(fam_name, k, repr(knobs[k]))] += weight
                for other in self.families:
                    if other != fam_name:
                        raw[(other, k, repr(knobs[k]))] += 0.25 * weight
        for key, w in raw.items():
            fails[key] += w / (1 + worked.get(key, 0))

    def _kernel_families(self) -> list[Family]:
        fams = [f for f in self.families.values() if f.language != "pytorch"]
        if not fams and any(n.startswith("composed.") for n in self.families):
            # the composed library family's knobs (rest under Inductor, its tuning options) cover what
            # the reference's compile variants re-run; they stay the fallback of an uncaptured problem
            fams = [f for f in self.families.values() if f.name != GENERIC_FAMILY]
        return fams or list(self.families.values())

    @staticmethod
    def _judged(ctx: AgentContext) -> dict[str, tuple[Mapping[str, Any], Status]]:
        """Candidate id -> (knobs, status) of every judged candidate with knobs: the team's findings, then this
        agent's own history."""
        results: dict[str, tuple[Mapping[str, Any], Status]] = {}
        for f in shared_findings(ctx):
            if f.knobs:
                results[f.candidate_id] = (f.knobs, f.status)
        for c, v in ctx.history:
            if c.knobs:
                results[c.id] = (c.knobs, v.status)
        return results

    @staticmethod
    def inductor_fails(ctx: AgentContext) -> str | None:
        """Why a composition should run the rest of its graph eager here, or None: torch.compile of the
        reference was judged incorrect (Inductor's fused numerics leave the problem's tolerance: on the
        H200, L2/015, L2/041 and L2/069 failed the same way compiled, 95-98% of elements within it), or
        two compositions with the rest under Inductor were incorrect and none was correct."""
        if ctx.baselines.get("torch.compile") is Status.incorrect:
            return "torch.compile of the reference is incorrect here"
        results = SearchAgent._judged(ctx)
        compiled = [st for knobs, st in results.values()
                    if knobs.get("rest") == "inductor" and not knobs.get("emulate_casts")]  # fmt: skip
        eager_bad = any(knobs.get("rest") == "eager" and st is Status.incorrect for knobs, st in results.values())
        bad = sum(st is Status.incorrect for st in compiled)
        # an incorrect eager composition says the kernels fail too (L2/069's attention sites): Inductor is then
        # not the evidence's only suspect, and compiled compositions may be proposed again
        if bad >= 2 and not any(st.correct for st in compiled) and not eager_bad:
            return f"{bad} compositions with the rest under Inductor were incorrect, none correct"
        return None

    @staticmethod
    def emulation_fails(ctx: AgentContext) -> bool:
        """A composition whose Inductor rest rounds as eager does (``emulate_casts``) failed (incorrect, or it did not
        compile or run: Triton 3.6 crashed on some chains of emulated casts, pytorch#173547) and none was correct:
        the repair goes on to the rest eager."""
        emulated = [st for knobs, st in SearchAgent._judged(ctx).values()
                    if knobs.get("rest") == "inductor" and knobs.get("emulate_casts")]  # fmt: skip
        failed = (Status.incorrect, Status.compile_error, Status.runtime_error)
        return any(st in failed for st in emulated) and not any(st.correct for st in emulated)

    @staticmethod
    def _moved(fam: Family, point: dict[str, Any], change: dict[str, Any]) -> dict[str, Any] | None:
        try:
            new = fam.check_point({**point, **change})
        except ValueError:
            return None
        return new if fam.valid(new) else None

    @classmethod
    def _eager_rest(cls, fam: Family, point: dict[str, Any]) -> dict[str, Any] | None:
        """``point`` with the rest of the graph eager, where it had it under Inductor (else None)."""
        rest = next((k for k in fam.knobs if k.name == "rest"), None)
        if point.get("rest") != "inductor" or rest is None or "eager" not in rest.values:
            return None
        return cls._moved(fam, point, {"rest": "eager"})

    @classmethod
    def _emulated(cls, fam: Family, point: dict[str, Any]) -> dict[str, Any] | None:
        """``point`` with its Inductor rest rounding each fused op as eager does, where it compiled the rest with
        Inductor's own numerics and the family has the knob (else None)."""
        if point.get("rest") != "inductor" or point.get("emulate_casts"):
            return None
        if not any(k.name == "emulate_casts" for k in fam.knobs):
            return None
        return cls._moved(fam, point, {"emulate_casts": True})

    def _repaired(self, fam: Family, point: dict[str, Any]) -> tuple[dict[str, Any], str] | None:
        """``point`` moved off Inductor's fused numerics once Inductor is the suspect, and a note: its rest rounding
        as eager does, or the rest eager where an emulated composition failed too (``emulation_fails``) or the
        family has no such knob; None where ``point`` needs no move."""
        if not self._eager_only:
            emulated = self._emulated(fam, point)
            if emulated is not None:
                return emulated, "Inductor rounding as eager"
            if point.get("emulate_casts"):
                return None
        eager = self._eager_rest(fam, point)
        return (eager, "rest eager") if eager is not None else None

    def _seed_candidates(self, ctx: AgentContext, n: int, seen: set[str], why_eager: str | None = None
                         ) -> list[Candidate]:  # fmt: skip
        """This agent's share of the composed problem's start points not measured yet: all of them for a
        lone generalist, else the ``rank``-th slice of ``n`` in the agent's first round (the team's first
        round then measures the list in order)."""
        if not self._seeds:
            return []
        if self.strategy == "generalist":
            mine = self._seeds
        elif ctx.history:
            return []
        else:
            mine = self._seeds[self.rank * n : (self.rank + 1) * n]
        out: list[Candidate] = []
        for j, (fam, point) in enumerate(mine):
            if len(out) >= n:
                break
            moved = self._repaired(fam, point) if why_eager else None
            note = f" ({moved[1]}: {why_eager})" if moved is not None else f" (rest={point.get('rest', '-')})"
            point = moved[0] if moved is not None else point
            cand = Candidate(source=fam.render(point), language=fam.language, agent=self.name, strategy=self.strategy,
                             family=fam.name, knobs=dict(point),
                             rationale=f"{self.strategy}: start point {j + 1} of {fam.name}{note}"[:300])  # fmt: skip
            if cand.id in seen:
                continue
            seen.add(cand.id)
            self._parents[cand.id] = (None, None)
            out.append(cand)
        return out

    def _eager_repair(self, ctx: AgentContext, seen: set[str], why_eager: str) -> list[Candidate]:
        """A start point judged incorrect with the rest of its graph under Inductor, again with the rest eager (one
        candidate, or none): once Inductor is the suspect (``inductor_fails``), the leading designs are judged on
        their own numerics. On the H200 (run DJ, L2/004), the fused add + RMSNorm and library points failed compiled
        (96.8% of elements within the tolerance, as torch.compile itself), later points turned eager, and the
        leading kernel was never judged eager. A team's agents, asked at once, take these repairs by rank (the
        ``rank``-th one still to judge; a lone generalist the first), as they share the start points."""
        status = {f.candidate_id: f.status for f in shared_findings(ctx)}
        status |= {c.id: v.status for c, v in ctx.history}
        todo: list[tuple[int, Family, dict[str, Any], str]] = []
        queued: set[str] = set()  # two start points can share a repair (the traced and untraced replays, eager)
        for j, (fam, point) in enumerate(self._seeds):
            # each variant is judged once the one before it failed: compiled (incorrect), then Inductor rounding as
            # eager (incorrect, or it did not compile or run; skipped once an emulated composition failed), then the
            # rest eager
            failed = False  # the variant before this one failed (a skipped emulated one: it or the one before it)
            for i, (var, var_id, how) in enumerate(self._seed_variants(j, fam, point)):
                skip = self._eager_only and how == "emulated"
                if i and failed and not skip and var_id not in seen:
                    if var_id not in queued:
                        queued.add(var_id)
                        todo.append((j, fam, var, how))
                    break
                st = status.get(var_id)
                mine = st is Status.incorrect if how == "compiled" else st is not None and not st.correct
                failed = (failed or mine) if skip else mine
        pick = 0 if self.strategy == "generalist" else self.rank
        if pick >= len(todo):
            return []
        j, fam, point, how = todo[pick]
        label = "with Inductor rounding as eager" if how == "emulated" else "with the rest eager"
        cand = Candidate(source=fam.render(point), language=fam.language, agent=self.name, strategy=self.strategy,
                         family=fam.name, knobs=dict(point),
                         rationale=f"{self.strategy}: start point {j + 1} of {fam.name} again {label} "
                                   f"({why_eager})"[:300])  # fmt: skip
        seen.add(cand.id)
        self._parents[cand.id] = (None, None)
        return [cand]

    def _seed_variants(self, j: int, fam: Family, point: dict[str, Any]) -> list[tuple[dict[str, Any], str, str]]:
        """Start point ``j`` and its repairs, each (point, candidate id, how): the point itself ("compiled"), with its
        Inductor rest rounding as eager ("emulated") and with the rest eager ("eager"), those that apply: rendered
        once per session, not at every proposal."""
        if j not in self._seed_ids:
            out = [(point, self._render_id(fam, point), "compiled")]
            for how, var in (("emulated", self._emulated(fam, point)), ("eager", self._eager_rest(fam, point))):
                if var is not None:
                    out.append((var, self._render_id(fam, var), how))
            self._seed_ids[j] = out
        return self._seed_ids[j]

    def _best_point(self, info: _Info) -> tuple[Family, dict[str, Any], str | None, str]:
        if info.known:
            _, fam, point, cid, why = info.known[0]
            return fam, point, cid, why
        fams = self._kernel_families()
        fam = fams[self.rng.randrange(len(fams))]
        return fam, dict(fam.start), None, f"starting family {fam.name}"

    def _explore_base(self, ctx: AgentContext, info: _Info) -> tuple[Family, dict[str, Any], str | None, str]:
        champ_fam = ctx.champion.family if ctx.champion else None
        fams = [f for f in self._kernel_families() if f.name != champ_fam] or self._kernel_families()
        # keep climbing the island while it improves; leave it after three proposals without a gain
        island = self.families.get(self._island or "")
        if island is not None and island.name != champ_fam and self._island_stale < 3:
            own = [k for k in info.known if k[1].name == island.name]
            if own:
                _, fam, point, cid, _ = own[0]
                return fam, point, cid, f"climbing {fam.name} from its best point"
        untried = [f for f in fams if info.tried.get(f.name, 0) == 0]
        pool = untried or sorted(fams, key=lambda f: info.tried.get(f.name, 0))[:2]
        fam = pool[self.rng.randrange(len(pool))]
        self._island, self._island_best, self._island_stale = fam.name, math.inf, 0
        own = [k for k in info.known if k[1].name == fam.name]
        if own and self.rng.random() < 0.5:
            _, _, point, cid, _ = own[0]
            return fam, point, cid, f"climbing {fam.name} from its best point"
        # A family's first kernel is its start point (the family's own best guess, e.g. softmax.rowblock's
        # 92%-of-copy point): a random or ported first point can lead every later proposal away from it.
        if info.tried.get(fam.name, 0) == 0:
            return fam, dict(fam.start), None, f"starting family {fam.name}"
        src = [(w[0].name, w[1]) for w in info.wins if w[0].language != "pytorch"][:1]
        src = src or [(k[1].name, k[2]) for k in info.known if k[1].language != "pytorch"][:1]
        ported = self._port(fam, *src[0]) if src else None
        if ported is not None and self.rng.random() < 0.5:
            return fam, ported, None, f"porting the best {src[0][0]} point to {fam.name}"
        point = dict(fam.start) if self.rng.random() < 0.5 else self._random_point(fam)
        return fam, point, None, f"exploring family {fam.name}"

    def _transplant_base(self, info: _Info) -> tuple[Family, dict[str, Any], str | None, str] | None:
        sources = [w for w in info.wins if w[0].language != "pytorch"][:3]
        sources += [(k[1], k[2], k[3]) for k in info.known[:3] if k[1].language != "pytorch"]
        if not sources:
            return None
        src_fam, src_knobs, _ = sources[0] if self.rng.random() < 0.6 else self.rng.choice(sources)
        targets = [f for f in self._kernel_families() if f.name != src_fam.name]
        if not targets:
            return None
        fam = self.rng.choice(targets)
        if info.tried.get(fam.name, 0) == 0 and fam.name not in self._opened:
            # A family's first kernel is its start point, whichever operator opens it: on the H200 (softmax
            # 4096x32768, seed 0) a port opened softmax.rowblock at 0.1745 ms, every later rowblock climbed
            # from there, and its start point (0.139 ms, 94% of a copy) was never measured in 40 candidates.
            self._opened.add(fam.name)
            return fam, dict(fam.start), None, f"starting family {fam.name} before porting a {src_fam.name} win"
        ported = self._port(fam, src_fam.name, src_knobs)
        if ported is None:
            return None
        return fam, ported, None, f"transplanting a {src_fam.name} win to {fam.name}"

    def _redirected(self, ctx: AgentContext, info: _Info) -> tuple[Family, dict[str, Any], str | None, str] | None:
        ev = ctx.plateau
        fam = self.families.get(ev.target_family or "") if ev is not None else None
        if fam is None:
            return None
        self._island, self._island_best, self._island_stale = fam.name, math.inf, 0
        # the best point of the session, ported to the target family, unless that port was measured: a
        # family climbed from its own (often far slower) best point needs many steps to matter, while the
        # best design's tile shape usually carries over (the step the breaker exists for)
        best = next(((k[1], k[2]) for k in info.known if k[1].language != "pytorch"), None)
        ported = self._port(fam, best[0].name, best[1]) if best is not None else None
        if (
            ported is not None
            and self._render_id(fam, ported) not in ctx.seen
            and not info.near_duplicate(fam.name, ported)
        ):
            return (
                fam,
                ported,
                None,
                f"plateau ({ev.action.value}): porting the best {best[0].name} point to {fam.name}",
            )
        own = [k for k in info.known if k[1].name == fam.name]
        if own:
            _, _, point, cid, _ = own[0]
            return fam, point, cid, f"plateau ({ev.action.value}): climbing {fam.name} from its best point"
        src = [(w[0].name, w[1]) for w in info.wins if w[0].language != "pytorch"][:1]
        ported = self._port(fam, *src[0]) if src else None
        return fam, ported or dict(fam.start), None, f"plateau ({ev.action.value}): starting {fam.name}"

    # -- moves ---------------------------------------------------------------------------
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

    def _mutate(
        self,
        fam: Family,
        point: dict[str, Any],
        gains: dict,
        fails: dict,
        lead: str | None = None,
        sens: Mapping[str, float] | None = None,
        inert: set[str] | frozenset[str] = frozenset(),
    ) -> tuple[dict[str, Any], str]:
        """One or two knob moves (any knob; with ``lead``, the first move is a knob of that class),
        knobs drawn by how much they mattered so far (``sens``), values weighted by the board, then
        repaired through the other knobs if infeasible."""
        knobs = list(fam.knobs)
        led = [k for k in knobs if k.strategy == lead] if lead else []
        steps = 1 if self.rng.random() < 0.6 else 2

        def draw(pool: list[Knob]) -> Knob:
            # a knob whose every single-knob comparison timed alike is drawn rarely (it moved nothing so far)
            w = [0.03 if k.name in inert else 0.15 + (sens.get(k.name, 0.5) if sens else 0.5) for k in pool]
            return self.rng.choices(pool, weights=w)[0]

        picks = [draw(led)] if led else []
        while len(picks) < min(steps, len(knobs)):
            k = draw([k for k in knobs if k not in picks])
            picks.append(k)
        new = dict(point)
        notes = []
        for knob in picks:
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
            key = (fam.name, knob.name, repr(v))
            hint = f" (measured: {sum(gains[key]) / len(gains[key]):+.2f} log-speed with it)" if key in gains else ""
            notes.append(f"{knob.name} {cur}→{v}{hint}")
        moved = [k.name for k in picks if new.get(k.name) != point.get(k.name)]
        if not fam.valid(new):
            fixed = repair(fam, new, moved, self.rng)
            if fixed is not None:
                follow = [f"{k} {new.get(k)}→{v}" for k, v in fixed.items() if new.get(k) != v]
                notes.append("to stay feasible " + ", ".join(follow))
                new = fixed
        return new, "; ".join(notes)

    def _surrogate(self, fam: Family, ctx: AgentContext, cache: dict[str, Surrogate]) -> Surrogate:
        """Model of this family's speed (1 / latency) from the board and this agent's own verdicts."""
        if fam.name not in cache:
            obs: list[tuple[dict[str, Any], float]] = []
            findings = shared_findings(ctx)
            for f in findings:
                lat = _latency_of(f)
                if f.family == fam.name and f.knobs and f.status.correct and lat:
                    obs.append((f.knobs, 1.0 / lat))
            posted = {f.candidate_id for f in findings}
            for c, v in ctx.history:
                if c.family == fam.name and v.correct and v.latency_ms and c.id not in posted:
                    obs.append((c.knobs, 1.0 / v.latency_ms))
            cache[fam.name] = Surrogate(fam, obs)
        return cache[fam.name]

    def _best_move(self, fam: Family, base: dict[str, Any], info: _Info, model: Surrogate, seen: set[str],
                   lead: str | None = None, k: int = 6) -> tuple[dict[str, Any], str]:  # fmt: skip
        """Draw ``k`` local moves and keep the one the surrogate ranks highest (the first when it has too
        little data)."""
        moves: list[tuple[dict[str, Any], str]] = []
        keys = set()
        inert = {kn.name for kn in fam.knobs if info.inert(fam.name, kn.name, pairs=1)}
        for _ in range(3 * k):
            point, note = self._mutate(fam, base, info.gains, info.fails, lead, info.sens.get(fam.name), inert)
            key = tuple(sorted((n, repr(v)) for n, v in point.items()))
            if key in keys or not fam.valid(point) or self._render_id(fam, point) in seen:
                continue
            if info.near_duplicate(fam.name, point):
                continue
            keys.add(key)
            moves.append((point, note))
            if len(moves) >= k:
                break
        if not moves:
            return self._mutate(fam, base, info.gains, info.fails, lead, info.sens.get(fam.name))
        if not model.ready or len(moves) == 1:
            return moves[0]
        scored = [(model.score(p), i) for i, (p, _) in enumerate(moves)]
        best = max(scored)[1]
        point, note = moves[best]
        return point, f"{note} (model's pick of {len(moves)} moves, fitted on {model.n} points)"

    def _continue(self, seen: set[str], info: _Info | None = None, why_eager: str | None = None) -> Candidate | None:
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
            new = fam.check_point(self._pinned(fam, new))
            moved = self._repaired(fam, new) if why_eager else None
            if moved is not None:
                new = moved[0]
                notes.append(f"{moved[1]} ({why_eager})")
            if info is not None and info.near_duplicate(fam.name, new):
                continue
            note = f"continuing the step that gained {gain:+.0%}: " + ", ".join(notes)
            rationale = f"{self.strategy}: {fam.name} {note}"[:300]
            cand = Candidate(source=fam.render(new), language=fam.language, agent=self.name, strategy=self.strategy,
                             family=fam.name, knobs=new, rationale=rationale)  # fmt: skip
            if cand.id not in seen:
                return cand
        return None

    def _base(self, ctx: AgentContext, info: _Info, op: Operator) -> tuple[Family, dict[str, Any], str | None, str]:
        if op is Operator.explore:
            return self._explore_base(ctx, info)
        if op is Operator.transplant:
            got = self._transplant_base(info)
            if got is not None:
                return got
            return self._explore_base(ctx, info)  # nothing to port yet: find something first
        return self._best_point(info)

    def propose(self, ctx: AgentContext, n: int) -> Proposal:
        info = self._info(ctx)
        out: list[Candidate] = []
        seen = set(ctx.seen)
        models: dict[str, Surrogate] = {}
        redirect = ctx.plateau
        why_eager = self.inductor_fails(ctx)
        self._eager_only = bool(why_eager) and self.emulation_fails(ctx)
        if redirect is None:
            out += self._seed_candidates(ctx, n, seen, why_eager)
            if why_eager and len(out) < n:
                out += self._eager_repair(ctx, seen, why_eager)
        for _ in range(n - len(out)):
            op, lead = self._operator()
            if redirect is None and op in (Operator.exploit, Operator.focus) and self.rng.random() < 0.7:
                cand = self._continue(seen, info, why_eager)
                if cand is not None:
                    seen.add(cand.id)
                    self._parents[cand.id] = (None, None)
                    self._op_of[cand.id] = op
                    out.append(cand)
                    continue
            for attempt in range(60):
                got = self._redirected(ctx, info) if redirect is not None else None
                fam, base, parent, why = got if got is not None else self._base(ctx, info, op)
                if parent is None:
                    point, note = base, why
                    if self._render_id(fam, point) in seen or info.near_duplicate(fam.name, point):
                        # the start or port is measured (or as good as): step from it
                        point, note = self._mutate(fam, base, info.gains, info.fails, lead)
                        note = f"{why}; {note}"
                else:
                    model = self._surrogate(fam, ctx, models)
                    point, note = self._best_move(fam, base, info, model, seen, lead)
                    note = f"{why}: {note}"
                try:
                    point = fam.check_point(self._pinned(fam, point))
                except ValueError:
                    continue
                if not fam.valid(point):
                    continue
                moved = self._repaired(fam, point) if why_eager else None
                if moved is not None:
                    point, note = moved[0], f"{note}; {moved[1]} ({why_eager})"
                if attempt < 45 and info.near_duplicate(fam.name, point):
                    continue  # the evidence says it times like a measured point; late attempts take it anyway
                label = f"{self.strategy}/{op.value}" if self.strategy == "generalist" else self.strategy
                cand = Candidate(source=fam.render(point), language=fam.language, agent=self.name,
                                 strategy=self.strategy, family=fam.name, knobs=point, parent=parent,
                                 rationale=f"{label}: {fam.name} {note}"[:300])  # fmt: skip
                if cand.id in seen:
                    continue
                seen.add(cand.id)
                self._parents[cand.id] = (parent, base if parent else None)
                if got is None:  # a plateau redirect's candidate is the breaker's, not the operator's
                    self._op_of[cand.id] = op
                out.append(cand)
                break
            redirect = None  # the plateau's redirect is spent on the first candidate
        return Proposal(out)

    def _credit(self, candidate: Candidate, verdict: Verdict, lat: float | None) -> None:
        """A try of the operator that proposed the candidate, and a win if the guard promoted it or it moved the
        frontier: faster than every family kernel judged before it, by the record margin (the first one too).
        A family's first or best kernel far behind the frontier is no win: it cost a slot and moved nothing."""
        fam = candidate.family
        best = self._fam_best.get("")
        win = verdict.status is Status.champion or (
            lat is not None and fam is not None and (best is None or lat * (1 + RECORD_MARGIN) < best)
        )
        if lat is not None and fam is not None and math.isfinite(lat):
            self._fam_best[""] = min(best if best is not None else math.inf, lat)
        op = self._op_of.pop(candidate.id, None)
        if op is not None:
            stats = self._op_stats.setdefault(op, [0, 0])
            stats[0] += 1
            stats[1] += int(win)

    def _pinned(self, fam: Family, point: dict[str, Any]) -> dict[str, Any]:
        """``point`` with the agent's pinned knobs (``_pins``) at their values, those the family has."""
        names = {k.name for k in fam.knobs}
        return {**point, **{k: v for k, v in self._pins.items() if k in names}}

    @staticmethod
    def _render_id(fam: Family, point: dict[str, Any]) -> str:
        try:
            return Candidate(source=fam.render(fam.check_point(point)), language=fam.language).id
        except Exception:  # noqa: BLE001
            return ""

    def observe(self, candidate: Candidate, verdict: Verdict) -> str | None:
        parent, base = self._parents.pop(candidate.id, (None, None))
        lat = verdict.latency_ms if verdict.correct else None
        self._credit(candidate, verdict, lat)
        if lat is not None and math.isfinite(lat):
            self._lat[candidate.id] = lat
            parent_lat = self._lat.get(parent) if parent else None
            if base and parent_lat and lat * 1.02 < parent_lat and candidate.family:
                moves = [(k, base.get(k), v) for k, v in candidate.knobs.items() if base.get(k) != v]
                self._momentum.append((candidate.family, dict(candidate.knobs), moves, parent_lat / lat - 1))
                self._momentum = self._momentum[-4:]
        if candidate.family is not None and candidate.family == self._island:
            if lat is not None and lat < self._island_best * 0.995:
                self._island_best, self._island_stale = lat, 0
            else:
                self._island_stale += 1
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
