"""The guard's settings: one type for the ``guard.*`` config keys and for what a Guard runs with.

The user-facing fields are the config group ``guard`` (conf/guard, Hydra's schema through
``kernelarc.config.KernelArcConfig.guard``). The fields marked ``omegaconf_ignore`` are not config
keys (so neither CLI overrides nor MLflow params): the wiring resolves them from other keys
(``executor.prestart``, ``task.workloads``) with :meth:`GuardSettings.resolved`, or they are the
judge's internal constants, which tests and the simulated guard may set directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

# Not a config key: derived by the wiring, or an internal constant of the judge.
_INTERNAL = {"omegaconf_ignore": True}

# The consistency factor where ``guard.consistency`` is null: the CPU's timers are coarse and noisy.
CONSISTENCY_GPU = 1.5
CONSISTENCY_CPU = 4.0


@dataclass
class GuardSettings:
    seeds: int = 3  # fresh random input sets per workload and candidate
    seed_pool: int = 8  # seeds are drawn from a pool this large, so references can be cached
    timeout_s: float = 120.0  # wall limit per candidate, GPU queueing excluded
    baseline_timeout_s: float = 900.0  # torch.compile (and max-autotune) of a reference may take minutes
    build_timeout_s: float = 300.0  # added for CUTLASS candidates: a first nvcc build takes about a minute
    # added to the warm-up of a candidate that calls torch.compile (Inductor compiles at the first calls): on the H200
    # with eight suite sessions compiling at once, 16 of 141 composed candidates that compile the rest of their graph
    # had no result within guard.timeout_s=40 s; once warmed up, the plain limit applies again
    compile_timeout_s: float = 300.0
    warmup_ms: float = 25.0
    target_ms: float = 100.0  # timed time per workload and evaluation, shared by challenger and champion
    min_iters: int = 5
    max_iters: int = 200
    flush_mb: int = 256  # > the 50 MB L2 of an H200, cleared before every timed call
    min_gain: float = 0.01  # promotion needs at least this speedup ...
    noise_factor: float = 1.0  # ... and more than this many relative IQRs
    consistency: float | None = None  # champion side by side vs alone may differ at most this factor (null: per device)
    hp_reference: bool = True  # also run the reference in float64 (the rel_err metric), where memory allows
    compile_baseline: bool = True  # measure torch.compile of the reference as a second baseline
    # torch.compile with no result within the budget (its compile timed out or had no time left) is measured once
    # after the search, at most baseline_timeout_s, side by side with the champion (and may still be crowned):
    # a champion is never reported without its torch.compile comparison for want of time
    compile_after_budget: bool = True
    # A searched champion not crowned beside torch.compile itself is timed beside it once more after the search and
    # kept only if faster beyond the noise (guard.decision.decide, torch.compile as the incumbent); else torch.compile
    # is crowned: a kernel KernelArc reports is proven faster than what its user would otherwise run
    prove_vs_compile: bool = True
    # Seconds a warm-up (JIT compilation, autotuning, first calls) may hold the device lock shared, so that no other
    # process times on the GPU meanwhile (its kernels would time-slice with the measured ones); past it the warm-up
    # goes on without it. 0 (the default): warm-ups never wait for, nor hold back, a timing. Measured on the H200
    # suite (8 sessions on one GPU, 15 s): void comparisons 11% instead of 14.5%, but half the candidates judged
    # in L1 and a fifth in L2 (BENCHMARKS.md, runs Y-Z2): worth it for a few sessions on a GPU, not for eight.
    warmup_lock_s: float = 0.0
    # Seconds a worker may wait, in all, for other processes' timings on its device before its warm-ups' GPU
    # benchmarking (Triton's and Inductor's autotuning) runs, under the device lock taken shared (guard/benchlock.py):
    # the heaviest kernels of a warm-up never beside a timing, its compilation free to run. 0 (the default): off. On
    # an H100 with 12 sessions (BENCHMARKS.md, runs F1/F2) it judged a fifth fewer candidates for 6.2% void
    # comparisons against 7.0%.
    bench_lock_s: float = 0.0
    memory_gb: float | None = None  # memory cap per device for the guard's memory plan (null: the device's memory)

    # -- resolved by the wiring from other config keys ----------------------------------------
    # Workers kept started per device at least (executor.prestart); the pool keeps more where the evaluations
    # in flight consume more (``pool_size``), and the memory plan counts them (``resident_workers``).
    prestart: int = field(default=2, metadata=_INTERNAL)
    # Evaluations in flight per device (executor.parallel; None: a Guard used directly, whose pool keeps
    # ``prestart`` workers as its caller chose). Not named
    # ``parallel``: the memory plan reads that name for the workers it may allow, 3 where unset.
    in_flight: int | None = field(default=None, metadata=_INTERNAL)
    workloads: list[int] | None = field(default=None, metadata=_INTERNAL)  # workload indices (None: all)

    # -- the judge's internal constants -------------------------------------------------------
    timing: bool = field(default=True, metadata=_INTERNAL)
    rounds: int = field(default=4, metadata=_INTERNAL)  # timing rounds per workload: one burst per side each
    timed_checks: int = field(default=2, metadata=_INTERNAL)  # rounds whose challenger burst ends in a check
    clock_factor: float = field(default=3.0, metadata=_INTERNAL)  # unexplained judge wall time per call ...
    clock_slack_ms: float = field(default=0.2, metadata=_INTERNAL)  # ... plus half its median plus this
    # a challenger's checked timed calls (new inputs) all slower than this times the median of its timed calls (plus
    # a slack) skip no work only by chance: timed again once, then rejected (drive.Driver.skipped_work)
    skip_factor: float = field(default=1.5, metadata=_INTERNAL)
    # a problem whose inputs all come from its own get_inputs: a whole new draw before every timed call where one
    # costs at most this (timed in the memory plan's dry run; 0: never), else the calls repeat one content
    # (Guard.fresh_inputs)
    # (on an idle H100 the 45's draws took 0.2-8 ms, L1/001's 7 GB set 30 ms and L2/024's 13 GB 23 ms)
    fresh_inputs_ms: float = field(default=25.0, metadata=_INTERNAL)
    cupti: bool = field(default=True, metadata=_INTERNAL)  # CUPTI activity records where importable
    # One champion worker serves at most this many evaluations (0: a fresh one for each, as for every
    # challenger). It only ever runs the champion's code, and its timed outputs are checked like a
    # challenger's (``champion_checks``), so reusing it changes what it can do to nobody (judge.py).
    champion_reuse: int = field(default=32, metadata=_INTERNAL)
    champion_checks: int = field(default=1, metadata=_INTERNAL)  # champion rounds per workload ending in a check
    # A trusted baseline (torch.compile) cannot slow the champion on purpose, and on a shared GPU the champion beside
    # it ran 1.6-4x slower than when crowned (the plain factor kept a 12x faster torch.compile from its crown), so
    # its comparison is void only past this multiple of the consistency factor: a CPU session crowned a
    # torch.compile 70x slower than the reference once the reference, beside it, ran 228x slower than alone.
    trusted_slack: float = field(default=5.0, metadata=_INTERNAL)
    # A workload whose champion ran past the consistency factor is timed again at most this many times before the
    # comparison is void; one whose apparent gain is inside its noise, once more (drive.Driver.time_workload)
    retimes: int = field(default=2, metadata=_INTERNAL)

    @property
    def flush_bytes(self) -> int:
        return int(self.flush_mb) << 20

    @property
    def consistency_factor(self) -> float:
        """The consistency factor in force (a Guard built without the wiring: the GPU's)."""
        return CONSISTENCY_GPU if self.consistency is None else float(self.consistency)

    def pool_size(self) -> int:
        """Idle workers the pool keeps started: ``prestart`` or, where more, the fresh workers that ``in_flight``
        evaluations in flight take (a challenger's each; a champion's each where champion workers are single-use;
        with reuse one spare for the next champion, so a promotion waits for no start either)."""
        if self.in_flight is None:
            return max(self.prestart, 1)
        reuse = self.champion_reuse > 0
        need = max(self.in_flight, 1) * (1 if reuse else 2) + (1 if reuse else 0)
        return max(self.prestart, need)

    def resident_workers(self) -> int:
        """Worker processes (each a CUDA context) held beside the challengers in flight: the idle pool and, with
        reuse, the champion's (the memory plan counts their contexts)."""
        return self.pool_size() + (1 if self.champion_reuse > 0 else 0)

    def resolved(
        self, *, on_cpu: bool, prestart: int, workloads: list[int] | None, parallel: int | None = None
    ) -> GuardSettings:
        """A copy with the derived fields set: what the session's guards run with."""
        consistency = self.consistency
        if consistency is None:
            consistency = CONSISTENCY_CPU if on_cpu else CONSISTENCY_GPU
        par = self.in_flight if parallel is None else max(int(parallel), 1)
        return replace(self, prestart=prestart, workloads=workloads, consistency=consistency, in_flight=par)
