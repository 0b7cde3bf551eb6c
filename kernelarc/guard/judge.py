"""The judge: runs each candidate in an isolated worker and turns what comes back into a Verdict.

The judge owns the reference outputs (computed here, in the trusted process), compares
the candidate's outputs, enforces the time limit, serialises timing on each GPU, and
applies the promotion rule. Every outcome is a Verdict; nothing a candidate does can
stop the next candidate from running.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kernelarc.guard.buffers import JudgeBuffer, buffer_bytes, layout, scalar_values
from kernelarc.guard.compare import compare_output, stride_mismatch
from kernelarc.guard.decision import Decision, decide, geomean, median, rel_noise
from kernelarc.guard.devlock import DeviceLock
from kernelarc.guard.drive import Clock, Driver, Hard, Side, Stop, gpu_wait_message, timed_calls, wait_until
from kernelarc.guard.memory import memory_plan
from kernelarc.guard.pool import WorkerPool
from kernelarc.guard.protocol import Outputs
from kernelarc.guard.quiet import from_env as quiet_cores
from kernelarc.guard.sandbox import Role
from kernelarc.guard.settings import GuardSettings
from kernelarc.guard.static import calls_torch_compile, check_source
from kernelarc.models import LANGUAGES, Candidate, Status, Verdict, WorkloadResult
from kernelarc.tasks.inputs import JITTER_OFF, all_custom, distribution_for, load_module, make_inputs
from kernelarc.tasks.loader import Task

log = logging.getLogger(__name__)


# Largest output buffer a pool's worker gets at its start (bytes).
POOL_BUFFER_MAX = 1 << 30

# The one settings type of the guard (also the ``guard.*`` config keys); the old name stays an alias.
GuardConfig = GuardSettings


@dataclass
class Evaluation:
    verdict: Verdict
    samples: dict[int, list[float]] = field(default_factory=dict)
    champion_samples: dict[int, list[float]] = field(default_factory=dict)
    decision: Decision | None = None


@dataclass
class ChampionWorker:
    """One champion's worker, kept across the evaluations it serves (``GuardSettings.champion_reuse``).

    Why this stays honest (issue 15: reference and champion never run in a process that ran candidate code):
    the worker only ever runs this champion's source (``key``); no challenger's code enters it, and each
    challenger still gets a fresh worker of its own that is killed after its evaluation. What the champion can
    do does not grow with reuse: it already knew its role (it runs as the trusted role) and could keep state
    across evaluations (its role's home persists); now its timed outputs are also checked like a challenger's
    (judge-chosen fresh seeds on a secret round, ``champion_checks``), so a champion that skips work once it is
    champion fails its comparison; its integrity is checked after every burst (worker), and after every
    evaluation no process of its but the worker may exist (``Driver.champion_clean``). Every evaluation sends it
    its own fresh sets (the challenger's seeds: same distributions on both sides). A worker left mid-command,
    one that failed, and one that served ``champion_reuse`` evaluations are retired (killed); a new champion
    gets a new worker.
    """

    key: str
    worker: Any
    buffer: JudgeBuffer
    ready: bool = False  # imported and warmed up on every workload
    uses: int = 0  # evaluations handed to it
    users: int = 0  # evaluations using it now
    retired: bool = False
    setup: threading.Lock = field(default_factory=threading.Lock)


def champion_key(cand: Candidate) -> str:
    return hashlib.sha256(f"{cand.language}\0{cand.source}".encode()).hexdigest()


def layout_mismatch(strides: list[int] | None, ref: Any, shape: tuple[int, ...]) -> str | None:
    """The output contract on layout: an output has the reference output's strides (dimensions of size
    one ignored), which for almost every reference means contiguous row-major. Right values in another
    layout (column-major, a transposed view) are a different tensor to a caller that reads its memory."""
    if strides is None or len(strides) != len(shape):
        return f"reports strides {strides} for shape {list(shape)}"
    if isinstance(ref, torch.Tensor) and tuple(ref.shape) == tuple(shape):
        want = list(ref.stride())
    else:
        want, acc = [0] * len(shape), 1
        for d in range(len(shape) - 1, -1, -1):
            want[d], acc = acc, acc * max(shape[d], 1)
    if stride_mismatch(strides, want, shape):  # contiguous row-major, or the reference's strides
        return f"has strides {strides}, the reference's are {want} (outputs must be row-major or as the reference's)"
    return None


def detect_language(source: str) -> str:
    if "cutlass" in source:
        return "cutlass"
    if "triton" in source:
        return "triton"
    return "pytorch"


def reference_candidate(task: Task) -> Candidate:
    return Candidate(source=task.definition.reference, language="pytorch", agent="baseline", strategy="reference",
                     rationale="the task's PyTorch reference")  # fmt: skip


def compiled_candidate(task: Task) -> Candidate:
    src = (
        task.definition.reference
        + "\n\n# --- kernelarc: torch.compile baseline ---\n"
        + "_kernelarc_reference_run = run\n"
        + "_kernelarc_compiled = torch.compile(_kernelarc_reference_run, dynamic=False)\n\n\n"
        + "def run(*args):\n    return _kernelarc_compiled(*args)\n"
    )
    if "import torch" not in src:
        src = "import torch\n" + src
    return Candidate(source=src, language="pytorch", agent="baseline", strategy="torch.compile",
                     rationale="torch.compile of the reference")  # fmt: skip


def is_judge_baseline(task: Task, cand: Candidate, trusted: bool) -> bool:
    """``cand`` is one of the judge's own baselines to the byte (the reference, its torch.compile), judged trusted:
    the judge-clock rule does not reject it (``Driver.baseline``). Searched code judged trusted (the registry's
    incumbent, the final side by side) and anything an agent names "baseline" keep the rule."""
    return trusted and cand.id in {reference_candidate(task).id, compiled_candidate(task).id}


class Guard:
    """Evaluates candidates for one task on one device."""

    def __init__(self, task: Task, target: Any, device: str, cfg: GuardSettings | None = None, seed: int = 0):
        self.task = task
        self.target = target
        self.device = device
        self.cfg = cfg or GuardSettings()
        self.seed = seed
        self.workloads = self.cfg.workloads if self.cfg.workloads is not None else list(range(len(task.workloads)))
        self._pool: WorkerPool | None = None
        # one candidate checks or times on the device at a time, across this process and any other
        self._gpu = DeviceLock(device)
        self.quiet = quiet_cores()  # KERNELARC_QUIET_CPUS: measured workers on CPUs of their own (guard/quiet.py)
        self._refs: OrderedDict[tuple[int, int], tuple[list, list | None, bool]] = OrderedDict()
        self._refs_lock = threading.Lock()
        self._ref_mod = load_module(task.definition.reference, f"reference_{task.name}")
        self._counter = 0
        self._counter_lock = threading.Lock()
        self.work: dict[int, Any] = {}  # workload -> kernelarc.sol.Work
        self.baseline_ms: dict[int, float] = {}
        # Seconds spent computing the reference's outputs to check candidates against (under the device lock, so
        # never two at once): the problem's cost, which the session's budget does not count (SearchSession)
        self.reference_s = 0.0
        self.compile_ms: dict[int, float] = {}
        # (workload, output, input distribution) -> the reference's own relative L2 error against its float64 run,
        # the largest seen: the gross-error rule of the checks that have no float64 run (compare._gross_error)
        self._ref_rel: dict[tuple[int, str, str], float] = {}
        self._champ: ChampionWorker | None = None
        self._champ_lock = threading.Lock()
        self._pool_lock = threading.Lock()

    # -- lifecycle -------------------------------------------------------------------
    @property
    def pool(self) -> WorkerPool:
        with self._pool_lock:
            if self._pool is None:
                # Each worker's output buffer is made, mapped and (GPU) page-locked while it starts, for outputs up
                # to POOL_BUFFER_MAX (larger ones get a buffer per evaluation: idle workers would hold them).
                nbytes = buffer_bytes(self.task, self.workloads)
                self._pool = WorkerPool(self.device, self.cfg.pool_size(),
                                        buffer_bytes=nbytes if nbytes <= POOL_BUFFER_MAX else 0,
                                        bench_lock=(self._gpu.path, self.cfg.bench_lock_s))  # fmt: skip
            return self._pool

    def device_wait_s(self) -> float:
        """Seconds this guard's evaluations waited for the device while another process measured on it."""
        return self._gpu.foreign_wait_now()

    def close(self) -> None:
        with self._champ_lock:
            champ, self._champ = self._champ, None
        if champ is not None:
            champ.retired = True
            self._drop_champion(champ)
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> Guard:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- references ------------------------------------------------------------------
    def reference(self, wl: int, seed: int, hp: bool = True) -> tuple[list, list | None]:
        """The reference's outputs on the inputs of ``(wl, seed)`` and, where ``hp`` asks for it and the memory
        plan allows, its float64 outputs (None otherwise). The float64 run feeds the rel_err metric only, never
        the verdict, so the judge asks for it on one checked seed per workload (``Driver``), not on every fresh
        seed of the timed checks: on an H200 it was a fifth of the guard's time per candidate."""
        key = (wl, seed)
        hp = hp and self.cfg.hp_reference and memory_plan(self).hp_reference  # whether a float64 run is owed
        with self._refs_lock:
            cached = self._refs.get(key)
            if cached is not None:
                self._refs.move_to_end(key)
                if cached[2] or not hp:
                    return cached[0], cached[1]
        t_ref = time.monotonic()
        inputs = make_inputs(self.task, wl, seed, self.device)
        if cached is not None:  # computed without its float64 run: only that is missing
            outs = cached[0]
        else:
            if wl not in self.work:
                try:
                    from kernelarc.sol import count_work

                    work = count_work(self._ref_mod.run, inputs, io_bytes=self.task.io_bytes(wl))
                    out, work.output = work.output, None
                    self.work[wl] = work
                except Exception as e:  # noqa: BLE001 - SOL is a metric, never a reason to fail
                    log.warning("could not count work of workload %d: %s", wl, e)
                    out = self._ref_mod.run(*inputs)
            else:
                out = self._ref_mod.run(*inputs)
            outs = list(out) if isinstance(out, tuple | list) else [out]
        hps = None
        if hp:
            try:
                up = [
                    x.to(torch.float64) if isinstance(x, torch.Tensor) and x.is_floating_point() else x for x in inputs
                ]
                o = self._ref_mod.run(*up)
                hps = list(o) if isinstance(o, tuple | list) else [o]
                if len(hps) != len(outs):
                    hps = None
            except Exception:  # noqa: BLE001 - references that insist on their dtype get no fp64 check
                hps = None
        if self.device.startswith("cuda"):
            torch.cuda.synchronize()
        # a scalar output the reference returns as a 0-d tensor is its value (the worker reads a candidate's so)
        outs = scalar_values(self.task, wl, outs)
        hps = scalar_values(self.task, wl, hps) if hps is not None else None
        with self._refs_lock:
            self.reference_s += time.monotonic() - t_ref
            self._refs[key] = (outs, hps, hp)
            self._refs.move_to_end(key)
            while len(self._refs) > memory_plan(self).ref_cache_entries:
                self._refs.popitem(last=False)
        return outs, hps

    def fresh_inputs(self, wl: int) -> bool:
        """Whether every timed call of workload ``wl`` gets a whole new draw of its inputs (the worker's
        ``_redraw``): on a problem whose inputs all come from its own ``get_inputs`` (which the plain inputs' cheap
        in-place redraw cannot make), where one draw cost at most ``guard.fresh_inputs_ms`` (``draw_s``). The same
        answer for both sides of a timing: the judge asks once per timing."""
        if wl not in memory_plan(self).redraw:  # (only get_inputs problems' cheap draws with room for them)
            return False
        drawn = self.draw_s(wl)
        return drawn is not None and drawn * 1e3 <= self.cfg.fresh_inputs_ms

    def draw_s(self, wl: int) -> float | None:
        """What one draw of workload ``wl``'s inputs costs: the memory plan's dry run times one alone, under the
        device lock (the judge's own draws share the device with the evaluations in flight: 28 ms for a 0.23 ms
        draw of L1/008 on a busy H100)."""
        fp = memory_plan(self).footprints.get(wl)
        return fp.draw_s if fp is not None else None

    def stale_inputs(self, wl: int) -> str | None:
        """Why workload ``wl``'s timed calls repeat one content where ``fresh_inputs`` would not have them (None: they
        do not): a warning on the verdict, since only the checked calls' rule (``Driver.skipped_work``) then stands
        between a content memo and a gain of up to ``skip_factor``."""
        if not all_custom(self.task) or self.fresh_inputs(wl):
            return None
        drawn = self.draw_s(wl)
        cost = f"a draw of its inputs took {drawn * 1e3:.3g} ms" if drawn is not None else "no draw of its inputs timed"
        cheap = drawn is not None and 0 < drawn * 1e3 <= self.cfg.fresh_inputs_ms
        if cheap and wl not in memory_plan(self).redraw:
            cost = "the memory plan has no room for a new draw beside the sets it keeps"
        return (f"timed calls repeat one content ({cost}; guard.fresh_inputs_ms is {self.cfg.fresh_inputs_ms:g}): "
                "its checked timed calls alone tell a kept result")  # fmt: skip

    # -- evaluation ------------------------------------------------------------------
    def evaluate(
        self,
        cand: Candidate,
        champion: Candidate | None = None,
        *,
        trusted: bool = False,
        timeout_s: float | None = None,
        champion_reference: dict[int, float] | None = None,
        deadline: float | None = None,
        wait_allowance_s: float = 0.0,
    ) -> Evaluation:
        """Judge ``cand`` (against ``champion``). ``deadline``: a ``time.time()`` instant (the session's
        end) after which nothing more is waited for, the GPU lock included; None: only ``timeout_s``. It moves on
        by the time this evaluation waits behind another process on the device, up to ``wait_allowance_s``."""
        t_start = time.monotonic()
        hard = None
        if deadline is not None:
            hard = Hard(t_start + (deadline - time.time()), wait_allowance_s, self._gpu.foreign_wait_now)
        errors: list[str] = []
        warnings: list[str] = []
        if cand.language not in LANGUAGES:
            return self._verdict(cand, Status.compile_error, [f"unknown language {cand.language!r}"], t_start)
        if not trusted:
            rep = check_source(cand.source)
            if rep.syntax_error:
                return self._verdict(cand, Status.compile_error, [rep.syntax_error], t_start)
            if rep.violations:
                return self._verdict(cand, Status.rejected_hack, list(rep.violations), t_start)
            if rep.refused:
                return self._verdict(cand, Status.compile_error, list(rep.refused), t_start)
            if not rep.has_run:
                return self._verdict(cand, Status.compile_error, ["source defines no top-level run()"], t_start)
        # Seeds from the OS, never from the config: consecutive (so that one candidate's inputs cycle
        # through the input distributions), unknown to the worker until each is sent, one at a time.
        base = secrets.randbits(62)
        if (waited := self._take_gpu(hard)) is not None:
            return self._verdict(cand, Status.timeout, [gpu_wait_message(waited)], t_start)
        try:
            plan = memory_plan(self)  # once per guard: dry runs of the reference, on the device
        finally:
            self._gpu.release()
        not_run = dict(sorted(plan.verdicts.items()))

        def planned(ev: Evaluation) -> Evaluation:  # every verdict after the plan names the workloads it left out
            ev.verdict.workloads_not_run = dict(not_run)
            return ev

        if not plan.runnable:
            return planned(self._verdict(cand, Status.runtime_error, plan.errors(), t_start))
        self.workloads = plan.runnable
        warnings += plan.warnings()
        seeds = [base + j for j in range(plan.seeds)]
        if (waited := self._take_gpu(hard)) is not None:
            return planned(self._verdict(cand, Status.timeout, [gpu_wait_message(waited)], t_start))
        try:
            self.reference(self.workloads[0], seeds[0])
        except Exception as e:  # noqa: BLE001
            msg = f"reference failed on workload {self.workloads[0]}: {type(e).__name__}: {e}"
            return planned(self._verdict(cand, Status.runtime_error, [msg], t_start))
        finally:
            self._gpu.release()
        job = {
            "source": cand.source,
            "language": cand.language,
            "task_path": str(self.task.path),
            "workload_file": self.task.workload_file,
            "device": self.device,
            "cpu_threads": self.cpu_threads(),
            "audit": not trusted,  # the runtime audit hook on the candidate's own frames (trusted code is the judge's)
            "jitter": str(self.task.path) not in JITTER_OFF,  # draws scaled as the judge's are (inputs._jitter)
            "timing": {
                "warmup_ms": self.cfg.warmup_ms,
                "flush_bytes": self.cfg.flush_bytes,
                "cupti": self.cfg.cupti,
            },
        }
        timed_champion = champion is not None and self.cfg.timing
        role = Role.trusted if trusted else Role.candidate
        # the candidate's timeout is for the candidate: the judge's and the champion's known work comes on top
        known = self.known_cost_s(champion_reference if timed_champion else None, len(seeds))
        limit = run_limit = (timeout_s or self.cfg.timeout_s) + known
        if hard is not None:
            hard.at += known
        if cand.language == "cutlass":
            # nvcc builds the library while the candidate is imported; once it is imported, the plain
            # limit applies again, so a kernel that hangs on the GPU is killed as soon as any other.
            limit += self.cfg.build_timeout_s
        # Inductor compiles at a torch.compile'd function's first calls: the import and warm-up of searched code that
        # compiles get up to guard.compile_timeout_s more (Driver.run takes back what the warm-up leaves of it). The
        # baselines (the reference, its torch.compile) have the limits their callers give them.
        compile_s = self.compile_allowance_s(cand)
        limit += compile_s
        baseline = is_judge_baseline(self.task, cand, trusted)
        status, res = self._drive(job, champion if timed_champion else None, role, seeds, limit, run_limit, hard,
                                  champion_reference, compile_s, baseline)  # fmt: skip
        errors += res["errors"]
        warnings += res["warnings"]
        ev = self._finish(cand, status, errors, warnings, res, t_start, champion is not None, champion_reference,
                          trusted)  # fmt: skip
        return planned(ev)

    def compile_allowance_s(self, cand: Candidate) -> float:
        """Seconds of ``guard.compile_timeout_s`` a warm-up of ``cand`` may take beyond the plain limit: searched code
        that calls torch.compile (Inductor compiles at the first calls), whoever runs it (challenger, champion,
        registry incumbent); none for the baselines, which have their own limits."""
        if cand.agent == "baseline" or not calls_torch_compile(cand.source):
            return 0.0
        return float(self.cfg.compile_timeout_s)

    def known_cost_s(self, champion_ms: dict[int, float] | None, n_seeds: int) -> float:
        """Seconds an evaluation spends on work that is not the candidate's, bounded from the latencies already
        measured: the reference's outputs the judge computes for every checked input set (the reference's
        latency per call) and, beside a champion, the champion's own calls (its crowned latency: a warm-up, its
        checked calls and the timed calls of every timing, re-timings included), with half again for slack. On
        the H200, L1/094's reference takes 10 s a call: every challenger timed out on the champion's side
        ("champion worker failed ... not compared") within its 40 s, though the challenger itself took 0.5 ms.
        Milliseconds on ordinary problems."""
        cfg = self.cfg
        timings = 1 + max(cfg.retimes, 0)
        ref_calls = n_seeds + (cfg.timed_checks + cfg.champion_checks) * timings
        total_ms = 0.0
        for wl in self.workloads:
            total_ms += self.baseline_ms.get(wl, 0.0) * ref_calls
            ms = (champion_ms or {}).get(wl)
            if ms:
                # timed calls per burst: as many as fill half the target, at least two (the judge's rule)
                per_timing = max(timed_calls(ms, cfg.target_ms / 2, cfg.min_iters, cfg.max_iters), 2)
                total_ms += ms * (1 + (per_timing + cfg.champion_checks) * timings) + cfg.warmup_ms
        return 1.5 * total_ms / 1e3

    def cpu_threads(self) -> int | None:
        """Intra-op threads of a CPU worker: the cores shared out over the evaluations in flight (None on a GPU).
        torch's default (every core, in every worker) oversubscribes the cores once two evaluations run at once:
        on a 2-core machine with ``executor.parallel=2``, calls of 0.05 ms read 12-48 ms beside a busy worker
        (its threads waiting for descheduled ones), and the judge-clock rule rejected honest candidates for it."""
        if self.device.startswith("cuda"):
            return None
        if self.quiet is not None:  # measured on the quiet CPUs, one evaluation at a time (the device lock)
            return len(self.quiet.cpus)
        return max(1, (os.cpu_count() or 1) // max(int(self.cfg.in_flight or 1), 1))

    def _take_gpu(self, hard: Hard | None) -> float | None:
        """Take the device lock, waiting at most until ``hard``; None when taken, else the seconds waited."""
        t = time.monotonic()
        if wait_until(self._gpu.acquire, hard):
            return None
        return time.monotonic() - t

    def _drive(
        self,
        job: dict,
        champion: Candidate | None,
        role: Role,
        seeds: list[int],
        limit: float,
        run_limit: float,
        hard: Hard | None = None,
        champion_reference: dict[int, float] | None = None,
        compile_s: float = 0.0,
        baseline: bool = False,
    ) -> tuple[Status | None, dict]:
        res: dict[str, Any] = {"errors": [], "warnings": [], "samples": {}, "champion_samples": {}, "phases": {},
                               "checks": {}}  # fmt: skip
        status: Status | None = None
        cand: Side | None = None
        champ: Side | None = None
        slot: ChampionWorker | None = None
        clock = Clock(limit, hard)
        drv = Driver(self, clock, res)
        drv.champ_ref = champion_reference or {}  # workloads re-timed where the champion strays from it
        drv.baseline = baseline  # the judge-clock rule warns only (Driver.time_workload)
        nbytes = buffer_bytes(self.task, self.workloads)
        try:
            t = time.monotonic()
            w = self.pool.acquire()
            cand = Side("candidate", w, self._buffer_of(w, nbytes))
            drv.start(cand, job, role)  # it imports while the champion's worker is found or set up
            if champion is not None:
                slot = self._champion_worker(champion, job, nbytes, drv)
                champ = Side("champion", slot.worker, slot.buffer, ready=slot.ready)
            res["phases"]["worker_wait"] = time.monotonic() - t
            drv.measured = [s.worker.process.pid for s in (cand, champ) if s is not None]
            clock = drv.clock = Clock(limit, hard)  # worker start-up is not the candidate's time
            if champ is not None and not champ.ready:
                with slot.setup:  # another evaluation may be setting this champion up: once for all
                    if slot.retired:  # its set-up failed in that evaluation: nothing to compare with here
                        raise Stop(Status.runtime_error, "the champion's worker failed to set up", "champion")
                    champ.ready = slot.ready
                    if not champ.ready:
                        t = time.monotonic()
                        # a champion that compiles at its first calls compiles here, once for all the evaluations it
                        # serves: up to guard.compile_timeout_s more, and none of its set-up is the challenger's time
                        extra = self.compile_allowance_s(champion)
                        clock.extend(extra, " (and guard.compile_timeout_s for the champion's set-up)")
                        try:
                            drv.setup_champion(champ)
                        except BaseException:
                            slot.retired = True  # before the lock goes to an evaluation waiting for this set-up
                            raise
                        if extra:
                            clock.extend(-extra, "")
                            clock.excluded(time.monotonic() - t)
                        slot.ready = True
                        res["phases"]["champion_setup"] = time.monotonic() - t
            drv.run(cand, champ, seeds, job["language"], run_limit, compile_s)
            drv.finish([cand])
            res["phases"].update(cand.done.phases)
            notes = [x for x in cand.done.warnings if x.startswith("sandbox:")]
            log.debug("worker candidate: %s", "; ".join(notes))
            res["warnings"] += [x for x in cand.done.warnings if x not in res["warnings"] and x not in notes]
            res["samples"] = cand.samples
            if champ is not None:
                drv.champion_clean(champ)
                res["champion_samples"] = champ.samples
        except RuntimeError as e:  # a worker that could not start
            status = Status.runtime_error
            res["errors"].append(str(e))
        except Stop as e:
            if e.side == "champion":
                # Not the challenger's doing (the champion runs in its own process): no comparison.
                res["warnings"].append(f"champion worker failed ({e.status.value}: {e.message}); not compared")
                res["samples"] = cand.samples if cand is not None else {}
                res["champion_samples"] = {}
                res["champion_failed"] = True
                if slot is not None:
                    slot.retired = True
            else:
                status = e.status
                if e.message:
                    res["errors"].append(e.message)
        finally:
            drv.unlock()
            if cand is not None:
                self._scan_stdout(cand.worker.log_path, res)
                if res.pop("forged", False) and (status is None or status.correct):
                    status = Status.rejected_hack
                cand.worker.kill(wait=False)  # killed now; reaping, its buffers' release and its uid slot's follow
            if slot is not None:
                self._release_champion(slot, champ)
        return status, res

    # -- the champion's worker ---------------------------------------------------------
    def _champion_worker(self, champion: Candidate, job: dict, nbytes: int, drv: Driver) -> ChampionWorker:
        """The worker of ``champion``: the one that served it before where it may serve again, else a fresh one
        from the pool, its job sent (set up by the first evaluation that uses it)."""
        key = champion_key(champion)
        with self._champ_lock:
            cur = self._champ
            if cur is not None and (
                cur.key != key or cur.retired or cur.uses >= max(self.cfg.champion_reuse, 1) or not cur.worker.alive()
            ):
                cur.retired = True
                self._champ = None
                if cur.users == 0:
                    self._drop_champion(cur)
                cur = None
            if cur is None:
                w = self.pool.acquire()
                try:
                    buf = self._buffer_of(w, nbytes)
                except BaseException:
                    w.kill(wait=False)  # no worker is left behind by a buffer that could not be made
                    raise
                cur = ChampionWorker(key, w, buf)
                cjob = dict(job, source=champion.source, language=champion.language)
                try:
                    drv.start(Side("champion", w, buf), cjob, Role.trusted)
                except (OSError, TimeoutError) as e:
                    self._drop_champion(cur)
                    raise Stop(Status.runtime_error, f"the champion's worker took no job ({e})", "champion") from None
                if self.cfg.champion_reuse > 0:
                    self._champ = cur
            cur.uses += 1
            cur.users += 1
            return cur

    def _release_champion(self, slot: ChampionWorker, side: Side | None) -> None:
        with self._champ_lock:
            slot.users -= 1
            if side is None or side.busy or not slot.ready or self.cfg.champion_reuse <= 0:
                slot.retired = True  # mid-command, never set up, or single-use: not served again
            if side is not None and side.busy:
                # A reply is still on its way: another evaluation sharing this worker would read it as the answer
                # to its own command. Killed now, so that one sees a dead champion (not compared), not a forgery.
                slot.worker.kill(wait=False)
            if slot.retired and self._champ is slot:
                self._champ = None
            if slot.retired and slot.users == 0:
                self._drop_champion(slot)

    def _buffer_of(self, w: Any, nbytes: int) -> JudgeBuffer:
        """The output buffer an evaluation shares with worker ``w``: the one the pool made and the worker mapped
        while it started, where it is large enough, else one of its own (released with the worker, as that)."""
        if w.buffer is not None and w.buffer.nbytes >= nbytes:
            return w.buffer.ready()
        buf = JudgeBuffer(self.device, nbytes)
        w.keep.append(buf)
        return buf

    @staticmethod
    def _drop_champion(slot: ChampionWorker) -> None:
        slot.worker.kill(wait=False)  # its buffers are released with it

    def _scan_stdout(self, path: str, res: dict) -> None:
        # The worker's log is its own file (nothing it prints reaches the judge's streams); read at most
        # its first and last 64 KB, however much it wrote.
        p = Path(path)
        try:
            with p.open("rb") as f:
                head = f.read(1 << 16)
                f.seek(0, 2)
                size = f.tell()
                f.seek(max(size - (1 << 16), len(head)))
                text = (head + f.read(1 << 16)).decode(errors="replace")
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                p.unlink()
        cand_text = "\n".join(line for line in text.splitlines() if "Warning" not in line)
        if '"status"' in cand_text or "'status'" in cand_text or "latency_ms" in cand_text:
            res["errors"].append("candidate wrote verdict-like text to stdout (forging results)")
            res["forged"] = True
        elif text.strip():
            res["warnings"].append(f"worker output ({len(text)} bytes): {text.strip()[-300:]}")

    def _check_outputs(self, buf: JudgeBuffer, msg: Outputs, wl: int, seed: int, j: int, res: dict) -> bool:
        """Read the outputs from the judge's buffer, as the dtype and shape the task declares, and
        compare them with the reference of this seed. The worker's message only says what its tensors
        looked like; shape, dtype and layout are checked against the reference's here."""
        # float64 (a metric): the first checked seed, and any check of an input distribution whose reference error
        # (the gross-error rule's yardstick) is not known yet for this workload
        slots = layout(self.task, wl)
        dist = distribution_for(seed).value
        known = {sl.name: self._ref_rel.get((wl, sl.name, dist)) for sl in slots if sl.shape is not None}
        refs, hps = self.reference(wl, seed, hp=j == 0 or None in known.values())
        where = f"workload {wl} ({msg.tag.value}, seed {j})" if j >= 0 else f"workload {wl} (a checked timed call)"
        res["failed_matched"] = None  # where a value comparison fails: its share of elements within the tolerance
        if [m.name for m in msg.outputs] != [sl.name for sl in slots]:
            names = [m.name for m in msg.outputs]
            res["errors"].append(f"{where}: outputs {names}, expected {[sl.name for sl in slots]}")
            return False
        outs: list[Any] = []
        for sl, meta, ref in zip(slots, msg.outputs, refs, strict=False):
            if sl.shape is None:
                if meta.scalar is None:
                    res["errors"].append(f"{where}: output {sl.name} is not a scalar")
                    return False
                outs.append(meta.scalar)
                continue
            want = str(sl.dtype).removeprefix("torch.")
            if meta.shape != list(sl.shape) or meta.dtype != want:
                res["errors"].append(
                    f"{where}: output {sl.name} is {meta.dtype}{meta.shape}, expected {want}{list(sl.shape)}"
                )
                return False
            bad = layout_mismatch(meta.strides, ref, sl.shape)
            if bad:
                res["errors"].append(f"{where}: output {sl.name} {bad}")
                return False
            outs.append(buf.read(sl))
        if len(refs) != len(outs):
            res["errors"].append(f"{where}: the reference has {len(refs)} outputs, the task {len(outs)}")
            return False
        entry = res["checks"].setdefault(wl, {"max_abs_err": 0.0, "matched": 1.0, "rel_err": 0.0})
        for k, (name, _spec) in enumerate(self.task.definition.outputs.items()):
            tol = self.task.tolerance_rule(wl, name)
            hp = hps[k] if hps is not None else None
            c = compare_output(name, outs[k], refs[k], hp, tol.atol, tol.rtol, tol.ratio,
                               max_error_cap=tol.max_error_cap, allow_negative_inf=tol.allow_negative_inf,
                               ref_rel_known=known.get(name))  # fmt: skip
            if c.ref_rel is not None:
                self._ref_rel[(wl, name, dist)] = max(c.ref_rel, known.get(name) or 0.0)
            elif hp is not None and c.ok and name in known:  # a float64 run that was not finite: no yardstick
                self._ref_rel[(wl, name, dist)] = math.inf
            if c.max_abs_err is not None:
                entry["max_abs_err"] = max(entry["max_abs_err"], c.max_abs_err)
            if c.matched_ratio is not None:
                entry["matched"] = min(entry["matched"], c.matched_ratio)
            if c.rel_err is not None:
                entry["rel_err"] = max(entry["rel_err"], c.rel_err)
            if not c.ok:
                res["errors"].append(f"{where}: {c.message}")
                res["failed_matched"] = c.matched_ratio
                return False
        return True

    # -- verdicts ---------------------------------------------------------------------
    def _verdict(self, cand: Candidate, status: Status, errors: list[str], t_start: float) -> Evaluation:
        v = Verdict(candidate_id=cand.id, status=status, errors=errors, eval_seconds=time.monotonic() - t_start)
        return Evaluation(v)

    def _finish(self, cand, status, errors, warnings, res, t_start, had_champion: bool, champ_ref=None,
                trusted: bool = False) -> Evaluation:  # fmt: skip
        samples: dict[int, list[float]] = res["samples"]
        correct = status is None
        # A champion that failed after the challenger's checks stopped the timing early: the challenger, not at
        # fault, is correct and not compared. Before them, nothing says it is correct.
        if correct and res.get("champion_failed") and not res.get("checked"):
            status, correct = Status.runtime_error, False
            errors.append("the champion's worker failed before the candidate was checked; judge it again")
        if correct and self.cfg.timing and set(samples) != set(self.workloads) and not res.get("champion_failed"):
            status = Status.runtime_error
            errors.append("worker ended before timing every workload")
            correct = False
        decision = None
        if correct:
            if self.cfg.timing:
                decision = decide(
                    samples,
                    res["champion_samples"] if had_champion else None,
                    min_gain=self.cfg.min_gain,
                    noise_factor=self.cfg.noise_factor,
                    champion_reference=champ_ref,
                    consistency=self.cfg.consistency_factor * (self.cfg.trusted_slack if trusted else 1.0),
                )
                status = Status.champion if decision.promote else Status.correct_slower
                if "inconsistent" in decision.reason:
                    warnings.append(decision.reason)
            else:
                status = Status.correct_slower
        results = []
        for wl in self.workloads:
            r = WorkloadResult(index=wl, uuid=self.task.workloads[wl].uuid, axes=self.task.axes(wl))
            chk = res["checks"].get(wl)
            if chk:
                r.max_abs_err, r.matched_ratio, r.rel_err = chk["max_abs_err"], chk["matched"], chk["rel_err"] or None
            r.correct = correct
            if wl in samples:
                self._metrics(r, samples[wl])
                champ = res["champion_samples"].get(wl) if had_champion else None
                r.champion_ms = median(champ) if champ else None
            results.append(r)
        v = Verdict(
            candidate_id=cand.id,
            status=status,
            errors=errors,
            warnings=warnings,
            workloads=results,
            eval_seconds=time.monotonic() - t_start,
            phases={k: round(v, 4) for k, v in res["phases"].items()},
        )
        if correct and samples:
            self._aggregate(v)
            if decision is not None and not math.isnan(decision.speedup):
                v.speedup_vs_champion = decision.speedup
        return Evaluation(v, samples, res["champion_samples"], decision)

    def _metrics(self, r: WorkloadResult, samples: list[float]) -> None:
        lat = median(samples)
        r.latency_ms, r.noise, r.iterations = lat, rel_noise(samples), len(samples)
        work = self.work.get(r.index)
        sec = lat / 1e3
        if work is not None:
            r.flops, r.bytes = float(work.flops), float(work.io_bytes)
            r.tflops = r.flops / sec / 1e12 if r.flops else None
            r.tbps = r.bytes / sec / 1e12 if r.bytes else None
            try:
                from kernelarc.sol import sol_score, t_sol

                ts, bound = t_sol(work, self.target)
                r.t_sol_ms, r.sol_bound = ts * 1e3, bound
                r.sol_fraction = min(ts * 1e3 / lat, 10.0) if lat > 0 else None
                tb = self.baseline_ms.get(r.index)
                if tb:
                    r.sol_score = sol_score(lat, ts * 1e3, tb)
            except Exception as e:  # noqa: BLE001
                log.debug("no SOL metrics: %s", e)
        if self.baseline_ms.get(r.index):
            r.baseline_ms = self.baseline_ms[r.index]
            r.speedup_vs_baseline = r.baseline_ms / lat
        if self.compile_ms.get(r.index):
            r.compile_ms = self.compile_ms[r.index]
            r.speedup_vs_compile = r.compile_ms / lat

    @staticmethod
    def _aggregate(v: Verdict) -> None:
        ws = v.workloads

        def gm(attr):
            vals = [getattr(w, attr) for w in ws if getattr(w, attr) is not None]
            return geomean(vals) if len(vals) == len(ws) else None

        v.latency_ms = gm("latency_ms")
        v.noise = max((w.noise for w in ws if w.noise is not None), default=None)
        v.speedup_vs_baseline = gm("speedup_vs_baseline")
        v.speedup_vs_compile = gm("speedup_vs_compile")
        v.sol_fraction = gm("sol_fraction")
        v.sol_score = gm("sol_score")
        v.tflops = gm("tflops")
        v.tbps = gm("tbps")

    def set_baselines(self, reference: Evaluation | None, compiled: Evaluation | None) -> None:
        """Record T_b (and torch.compile) per workload, measured in this run."""
        for ev, store in ((reference, self.baseline_ms), (compiled, self.compile_ms)):
            if ev is None or not ev.verdict.correct:
                continue
            for wl, s in ev.samples.items():
                store[wl] = median(s)

    def refresh_metrics(self, ev: Evaluation) -> None:
        """Recompute derived metrics (after baselines became known)."""
        if not ev.verdict.correct:
            return
        for r in ev.verdict.workloads:
            if r.index in ev.samples:
                self._metrics(r, ev.samples[r.index])
        self._aggregate(ev.verdict)
