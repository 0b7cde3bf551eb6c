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
    warmup_ms: float = 25.0
    target_ms: float = 100.0  # timed time per workload and candidate
    min_iters: int = 5
    max_iters: int = 200
    flush_mb: int = 256  # > the 50 MB L2 of an H200, cleared before every timed call
    min_gain: float = 0.01  # promotion needs at least this speedup ...
    noise_factor: float = 1.0  # ... and more than this many relative IQRs
    consistency: float | None = None  # champion side by side vs alone may differ at most this factor (null: per device)
    hp_reference: bool = True  # also run the reference in float64 (the rel_err metric), where memory allows
    compile_baseline: bool = True  # measure torch.compile of the reference as a second baseline
    memory_gb: float | None = None  # memory cap per device for the guard's memory plan (null: the device's memory)

    # -- resolved by the wiring from other config keys ----------------------------------------
    prestart: int = field(default=2, metadata=_INTERNAL)  # workers kept started per device (executor.prestart)
    workloads: list[int] | None = field(default=None, metadata=_INTERNAL)  # workload indices (None: all)

    # -- the judge's internal constants -------------------------------------------------------
    timing: bool = field(default=True, metadata=_INTERNAL)
    rounds: int = field(default=4, metadata=_INTERNAL)  # timing rounds per workload: one burst per side each
    timed_checks: int = field(default=2, metadata=_INTERNAL)  # rounds whose challenger burst ends in a check
    clock_factor: float = field(default=3.0, metadata=_INTERNAL)  # unexplained judge wall time per call ...
    clock_slack_ms: float = field(default=0.2, metadata=_INTERNAL)  # ... plus half its median plus this
    cupti: bool = field(default=True, metadata=_INTERNAL)  # CUPTI activity records where importable

    @property
    def flush_bytes(self) -> int:
        return int(self.flush_mb) << 20

    @property
    def consistency_factor(self) -> float:
        """The consistency factor in force (a Guard built without the wiring: the GPU's)."""
        return CONSISTENCY_GPU if self.consistency is None else float(self.consistency)

    def resolved(self, *, on_cpu: bool, prestart: int, workloads: list[int] | None) -> GuardSettings:
        """A copy with the derived fields set: what the session's guards run with."""
        consistency = self.consistency
        if consistency is None:
            consistency = CONSISTENCY_CPU if on_cpu else CONSISTENCY_GPU
        return replace(self, prestart=prestart, workloads=workloads, consistency=consistency)
