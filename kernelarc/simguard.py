"""The simulated guard: a supported test double of :class:`kernelarc.guard.judge.Guard`.

``kernelarc.wiring.build_session(..., make_guard=simulated_guard_factory(...))`` runs the product's own loop (agents,
board, plateau breaker, dedupe, rematches, champion rule) with only the measurement replaced by a
deterministic cost model, so the search's reach and the team/memory ablation (``kernelarc.ablate``)
can be measured on a CPU in seconds. The model is deliberately *not* the search's surrogate:

* ``gemm``: a crude Hopper GEMM model (wgmma tile efficiency, register pressure per thread, pipeline
  depth, wave quantization, L2 grouping) whose optimum needs several coupled knobs at once (a 128x256
  tile pays only with 8 warps and fewer stages);
* ``generic``: for any other family, a hashed quadratic bowl in knob-index space with pairwise
  couplings (the optimum of one knob moves with another), a per-family ceiling and a start point
  that is never the optimum.

Both have timing noise (log-normal samples, timed interleaved with the champion, judged by the
product's :func:`kernelarc.guard.decision.decide`), infeasible points the families' ``valid()`` does
not know about (compile errors: hidden resource limits) and incorrect points (a hidden numerical
bug on a structured region plus a sprinkle of hashed points). Everything is a pure function of the
candidate and the model seed, except the noise, which is seeded by (model seed, candidate id, how
many times that candidate was timed before), never by the order threads reach the guard in; and
the guard asks the session to take its verdicts in submission order (``ordered_verdicts``), so a
session on it is repeatable for a given seed whatever the thread timing.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kernelarc.families import Family, families_for
from kernelarc.guard.decision import decide, geomean, median, rel_noise
from kernelarc.guard.judge import Evaluation
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Candidate, Status, Verdict, WorkloadResult
from kernelarc.tasks.loader import Task

TRUSTED_SLACK = GuardSettings().trusted_slack  # the real guard's rule for a trusted baseline's comparison

# One GEMM shape (the issue-16 measurements use it): large enough that waves and tiles matter.
GEMM_SHAPE = (8192, 8192, 8192)
PEAK_FLOPS = 800e12
N_SMS = 132
GEMM_FAMILY_FACTOR = {"matmul.persistent_tma": 1.0, "matmul.tiled": 0.93, "matmul.splitk": 0.85}
# The library (the task's reference and torch.compile) is this much slower than the families' best
# point by default: a family kernel leads once it is within 30% of the optimum, so the champion
# tracks the search's progress from there (with 1.05 a run either finds the optimum or keeps the
# library, which says little per run).
LIBRARY_GAP = 1.30


class SimFailure(Enum):
    """Why the model refuses a point (what a real guard would report)."""

    compile_error = "compile_error"
    incorrect = "incorrect"


def _h(*parts: Any) -> float:
    """A deterministic uniform number in [0, 1) from ``parts``."""
    d = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(d[:8], "little") / 2**64


def _idx(fam: Family, name: str, value: Any) -> float:
    vals = fam.knob(name).values
    i = vals.index(value) if value in vals else 0
    return i / (len(vals) - 1) if len(vals) > 1 else 0.0


def gemm_latency(family: str, k: Mapping[str, Any], shape: tuple[int, int, int] = GEMM_SHAPE) -> float:
    """Milliseconds of one GEMM point under the crude Hopper model (see the module docstring)."""
    m, n, kk = shape
    bm, bn, bk, w, st = k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], k["num_warps"], k["num_stages"]
    eff = (min(bm, 128) / 128 * min(bn, 256) / 256) ** 0.6  # wgmma fill: 128x256 per CTA is the sweet spot
    eff *= {16: 0.5, 32: 0.75, 64: 1.0, 128: 0.95, 256: 0.7}.get(bk, 0.7)
    eff *= 1.0 if bm * bn / (w * 32) <= 128 else 0.45  # accumulator spills
    eff *= 1.0 if w >= 4 else 0.6
    eff *= {1: 0.5, 2: 0.8, 3: 1.0, 4: 1.0}.get(st, 0.97)
    waves = math.ceil(m / bm) * math.ceil(n / bn) / N_SMS
    eff *= waves / math.ceil(waves)
    eff *= 1.0 if k.get("GROUP_M", 1) >= 4 else 0.92  # L2 reuse
    if k.get("SPLIT_K", 1) > 1:  # at a square shape split-K only adds a reduction
        eff *= 1.0 / (1.0 + 0.04 * math.log2(k["SPLIT_K"]))
    eff *= GEMM_FAMILY_FACTOR.get(family, 0.8)
    return 2 * m * n * kk / (PEAK_FLOPS * eff) * 1e3


def gemm_failure(k: Mapping[str, Any]) -> SimFailure | None:
    """Hidden limits of the simulated toolchain and kernels: deep pipelines of wide K tiles fail to
    compile (a resource the families' ``valid()`` does not model); atomic split-K reductions of
    many splits breach the bf16 tolerance."""
    if k.get("num_stages", 0) >= 6 and k.get("BLOCK_K", 0) >= 128:
        return SimFailure.compile_error
    if k.get("REDUCE") == "atomic" and k.get("SPLIT_K", 1) >= 8:
        return SimFailure.incorrect
    return None


@dataclass(frozen=True)
class GenericModel:
    """A hashed bowl with couplings over one family's knob indices (any task)."""

    fam: Family
    seed: int

    def _p(self, *parts: Any) -> float:
        return _h(self.seed, self.fam.name, *parts)

    def latency(self, k: Mapping[str, Any]) -> float:
        names = [kn.name for kn in self.fam.knobs]
        x = {n: _idx(self.fam, n, k.get(n, self.fam.start.get(n))) for n in names}
        cost = 0.0
        for n in names:
            opt = self._p("opt", n)
            w = 0.3 + 1.2 * self._p("w", n)
            cost += w * (x[n] - opt) ** 2
        # couplings: the best value of b moves with a (a ridge that one-knob steps climb slowly)
        for a, b in itertools.combinations(names, 2):
            if self._p("pair", a, b) < 0.25:
                d = self._p("shift", a, b) - 0.5
                cost += 1.5 * (x[a] - x[b] - d) ** 2
        cost *= 3.0 / max(len(names), 3)  # a start a few times slower than the best, whatever the knob count
        ceiling = 1.0 + 0.25 * self._p("ceiling")  # families differ in their best attainable speed
        return ceiling * math.exp(cost)

    def failure(self, k: Mapping[str, Any]) -> SimFailure | None:
        names = [kn.name for kn in self.fam.knobs]
        hot = sorted(names, key=lambda n: self._p("res", n))[:2]
        if sum(_idx(self.fam, n, k.get(n, self.fam.start.get(n))) for n in hot) > 1.7:
            return SimFailure.compile_error  # a hidden resource limit over two knobs
        return None


_OPTIMA: dict[tuple, float] = {}  # see CostModel.optimum


class CostModel:
    """Latency (ms) per workload of a candidate, or why it fails, for one task's families."""

    def __init__(self, task: Task, seed: int = 0, incorrect_rate: float = 0.02, library_gap: float = LIBRARY_GAP):
        if library_gap <= 0:
            raise ValueError("library_gap must be positive")
        self.task = task
        self.seed = seed
        self.library_gap = library_gap
        self.incorrect_rate = incorrect_rate
        self.families = {f.name: f for f in families_for(task)}
        self.gemm = task.name == "matmul"
        self._generic = {n: GenericModel(f, seed) for n, f in self.families.items()}

    def point_latency(self, family: str | None, knobs: Mapping[str, Any]) -> float | SimFailure:
        fam = self.families.get(family or "")
        if fam is None:  # the reference, torch.compile and its variants: the library's speed
            return self.library_ms()
        if self.gemm:
            fail = gemm_failure(knobs)
            lat = gemm_latency(fam.name, knobs)
        else:
            fail = self._generic[fam.name].failure(knobs)
            lat = self._generic[fam.name].latency(knobs)
        if fail is not None:
            return fail
        key = tuple(sorted((n, repr(v)) for n, v in knobs.items()))
        if _h(self.seed, "bug", fam.name, key) < self.incorrect_rate:
            return SimFailure.incorrect
        return lat

    def optimum(self) -> float:
        """The best latency any family point reaches (exhaustive over the coupled knobs); computed once per
        process for a task, model seed and incorrect rate (an ablation builds a model per run)."""
        key = (self.task.name, self.seed, self.incorrect_rate, tuple(sorted(self.families)))
        if key not in _OPTIMA:
            _OPTIMA[key] = self._optimum()
        return _OPTIMA[key]

    def _optimum(self) -> float:
        best = math.inf
        for fam in self.families.values():
            if self.gemm:
                names = ["BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"]
                extra = {"GROUP_M": 8} if "GROUP_M" in {k.name for k in fam.knobs} else {}
            else:
                names = [k.name for k in fam.knobs]
                extra = {}
            space = [fam.knob(n).values for n in names]
            if math.prod(len(s) for s in space) > 100_000:
                best = min(best, self._descend(fam))
                continue
            for vals in itertools.product(*space):
                p = dict(fam.start, **dict(zip(names, vals, strict=True)), **extra)
                if not fam.valid(p):
                    continue
                lat = self.point_latency(fam.name, p)
                if isinstance(lat, float):
                    best = min(best, lat)
        return best

    def _descend(self, fam: Family, starts: int = 24) -> float:
        """Best of deterministic multi-start coordinate descents (spaces too large to enumerate)."""
        rng = random.Random(f"{self.seed}:{fam.name}:optimum")
        best = math.inf
        for _ in range(starts):
            p = {k.name: rng.choice(k.values) for k in fam.knobs}
            cur = self.point_latency(fam.name, p) if fam.valid(p) else math.inf
            cur = cur if isinstance(cur, float) else math.inf
            improved = True
            while improved:
                improved = False
                for k in fam.knobs:
                    for v in k.values:
                        q = {**p, k.name: v}
                        if q == p or not fam.valid(q):
                            continue
                        lat = self.point_latency(fam.name, q)
                        if isinstance(lat, float) and lat < cur:
                            p, cur, improved = q, lat, True
            best = min(best, cur)
        return best

    def library_ms(self) -> float:
        return self.optimum() * self.library_gap


class SimulatedGuard:
    """What :class:`kernelarc.session.SearchSession` needs of a guard, answered by a :class:`CostModel`.

    Each correct candidate is "timed" as ``samples`` log-normal draws around the model latency,
    interleaved with the champion's, and judged by the product's promotion rule.
    """

    # The session takes verdicts in the order it submitted the candidates (not as threads finish), so a
    # run depends on its seed only: a test double must be repeatable (SearchSession reads this).
    ordered_verdicts = True

    def __init__(self, task: Task, model: CostModel, *, noise: float = 0.01, samples: int = 7,
                 min_gain: float = 0.01, noise_factor: float = 1.0, consistency: float = 1.5,
                 delay_s: float = 0.0):  # fmt: skip
        if noise < 0 or samples < 1:
            raise ValueError("noise must be >= 0 and samples >= 1")
        self.task = task
        self.model = model
        self.noise = noise
        self.samples = samples
        self.min_gain = min_gain
        self.noise_factor = noise_factor
        self.consistency = consistency
        self.delay_s = delay_s  # wall seconds an evaluation takes (the equal-wall-clock ablation)
        self.workloads = [0]  # the model times one shape; dispatch composites are never planned
        self.baseline_ms: dict[int, float] = {}
        self.compile_ms: dict[int, float] = {}
        self._count: dict[tuple[str, str], int] = {}  # (candidate id, tag) -> times timed so far
        self._lock = threading.Lock()
        self.calls = 0

    def _draw(self, lat: float, cid: str, tag: str) -> list[float]:
        with self._lock:
            n = self._count[(cid, tag)] = self._count.get((cid, tag), 0) + 1
        rng = random.Random(f"{self.model.seed}:{cid}:{tag}:{n}")
        return [lat * math.exp(rng.gauss(0.0, self.noise)) for _ in range(self.samples)]

    def _latency(self, cand: Candidate) -> float | SimFailure:
        if cand.family is None or cand.family not in self.model.families:
            return self.model.library_ms()
        return self.model.point_latency(cand.family, cand.knobs)

    def evaluate(
        self,
        cand: Candidate,
        champion: Candidate | None = None,
        *,
        trusted: bool = False,
        timeout_s: float | None = None,
        champion_reference: dict[int, float] | None = None,
        deadline: float | None = None,  # the real guard's session end; a simulated evaluation never waits
        wait_allowance_s: float = 0.0,
    ) -> Evaluation:
        self.calls += 1
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        lat = self._latency(cand)
        if isinstance(lat, SimFailure):
            why = {SimFailure.compile_error: "simulated: out of a hidden resource at this point",
                   SimFailure.incorrect: "simulated: outputs beyond tolerance at this point"}[lat]  # fmt: skip
            return Evaluation(Verdict(candidate_id=cand.id, status=Status(lat.value), errors=[why], eval_seconds=0.0))
        samples = {0: self._draw(lat, cand.id, "c")}
        champ_samples: dict[int, list[float]] = {}
        if champion is not None:
            c_lat = self._latency(champion)
            if isinstance(c_lat, float):
                champ_samples = {0: self._draw(c_lat, cand.id, "champ")}
        d = decide(samples, champ_samples if champion is not None else None, min_gain=self.min_gain,
                   noise_factor=self.noise_factor, champion_reference=champion_reference,
                   consistency=self.consistency * (TRUSTED_SLACK if trusted else 1.0))  # fmt: skip
        status = Status.champion if d.promote else Status.correct_slower
        med = median(samples[0])
        r = WorkloadResult(index=0, uuid=self.task.workloads[0].uuid, axes=self.task.axes(0), correct=True,
                           latency_ms=med, noise=rel_noise(samples[0]), iterations=self.samples)  # fmt: skip
        if champ_samples:
            r.champion_ms = median(champ_samples[0])
        self._against_baselines(r)
        v = Verdict(candidate_id=cand.id, status=status, workloads=[r], latency_ms=geomean([med]), noise=r.noise,
                    speedup_vs_baseline=r.speedup_vs_baseline, speedup_vs_compile=r.speedup_vs_compile,
                    eval_seconds=0.0, phases={"timing": 0.0})  # fmt: skip
        if "inconsistent" in d.reason:  # as the real judge words a void comparison
            v.warnings.append(d.reason)
        if not math.isnan(d.speedup):
            v.speedup_vs_champion = d.speedup
        return Evaluation(v, samples, champ_samples, d)

    def set_baselines(self, reference: Evaluation | None, compiled: Evaluation | None) -> None:
        for ev, store in ((reference, self.baseline_ms), (compiled, self.compile_ms)):
            if ev is not None and ev.verdict.correct:
                for wl, s in ev.samples.items():
                    store[wl] = median(s)

    def _against_baselines(self, r: WorkloadResult) -> None:
        """A workload's latency against the baselines known now."""
        if not r.latency_ms:
            return
        if self.baseline_ms.get(r.index):
            r.baseline_ms, r.speedup_vs_baseline = self.baseline_ms[r.index], self.baseline_ms[r.index] / r.latency_ms
        if self.compile_ms.get(r.index):
            r.compile_ms, r.speedup_vs_compile = self.compile_ms[r.index], self.compile_ms[r.index] / r.latency_ms

    def refresh_metrics(self, ev: Evaluation) -> None:
        """Metrics against baselines measured after the verdict (torch.compile, measured beside the
        search), as the real guard derives them."""
        v = ev.verdict
        for r in v.workloads:
            self._against_baselines(r)
        for key in ("speedup_vs_baseline", "speedup_vs_compile"):
            vals = [getattr(r, key) for r in v.workloads if getattr(r, key)]
            if vals and len(vals) == len(v.workloads):
                setattr(v, key, geomean(vals))

    def close(self) -> None:
        """Nothing to release: the model holds no process or device."""


def simulated_guard_factory(
    model_seed: int = 0, library_gap: float = LIBRARY_GAP, **kw: Any
) -> Callable[[Task, str], SimulatedGuard]:
    """``make_guard`` for :func:`kernelarc.wiring.build_session`: one simulated guard per device,
    all sharing one cost model of the session's task."""
    models: dict[str, CostModel] = {}

    def make(task: Task, device: str) -> SimulatedGuard:
        model = models.setdefault(task.name, CostModel(task, seed=model_seed, library_gap=library_gap))
        return SimulatedGuard(task, model, **kw)

    return make
