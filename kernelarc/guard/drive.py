"""The judge's side of one evaluation: drives the challenger's worker and the champion's, interleaved.

The challenger and the champion (when there is one) each run in a worker of their own, so a
candidate can reach neither the champion's code nor its process nor its timing. The challenger's
worker is fresh and killed after its evaluation; the champion's runs only the champion's code and
serves several evaluations (``judge.ChampionWorker`` says why that stays honest). The judge drives
both with commands, one at a time, and decides everything from what comes back:

1. Both import their source (the challenger's static checks already passed in the judge); a
   champion's worker only once, with its warm-up, for all the evaluations it serves.
2. Warm-up calls (JIT compilation) on inputs from a throw-away seed, outside the per-GPU lock (with
   ``guard.warmup_lock_s``: under it, taken shared, for at most that long; devlock.py says why).
3. Under the lock: the challenger's checked calls, on inputs from seeds drawn from os.urandom and
   sent one at a time, only when used; every output compared with the judge's reference; the
   same buffers rewritten with another set's content and checked again. The champion builds the
   same timing sets without being called.
4. Timing, per workload: a warm-up burst each (the judge's own clock gives the call count; the
   timed time ``target_ms`` is shared by the sides), then ``rounds`` rounds of one burst per side,
   the order alternating, all under the lock. On a few judge-chosen rounds (secret until the burst)
   the challenger's last call, and on ``champion_checks`` rounds the champion's, runs on inputs
   staged from a fresh os.urandom seed and all its outputs are compared.
5. Cross-checks on the samples: the judge's wall clock around every burst must be able to contain
   the device time the worker reports, and the time it cannot explain must look like the other
   side's; CUPTI spans must not exceed CUDA event spans (work running past the end event).

Anything a worker does wrong (a failure, a wrong output, an invalid or oversized message, a
hang, an early exit) ends the evaluation with a status; nothing it sends is unpickled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kernelarc.guard.buffers import JudgeBuffer
from kernelarc.guard.decision import median, noise_bar, slowed_champion, workload_noise
from kernelarc.guard.pool import Worker
from kernelarc.guard.protocol import Cmd, Done, Fail, Imported, Ok, Outputs, ProtocolError, Tag, TimerMethod, Timing
from kernelarc.guard.sandbox import Role, find_processes, sandbox
from kernelarc.models import Status

log = logging.getLogger(__name__)
PROFILE: dict[str, float] = {}
# An apparent gain this large that the noise hides is timed again (``Driver.undecided``); smaller ones are not
UNDECIDED_GAIN = 1.25


def clock_violation(
    cand: list[float], champ: list[float], champ_median: float, factor: float, slack: float
) -> str | None:
    """The judge-clock rule. ``cand`` / ``champ``: per burst, the judge's wall time per call that the
    worker's reported device time does not explain (ms). A forged timer is forged in every burst,
    while preemption of a loaded host inflates only some, so the challenger's best burst is held
    against the champion's typical one: at most ``factor`` times it, plus half the champion's median
    call, plus ``slack``."""
    if not cand or not champ:
        return None
    best, typ = min(cand), median(champ)
    bound = factor * typ + 0.5 * champ_median + slack
    if best > bound:
        return (
            f"in every timed burst the judge's clock saw at least {best:.3f} ms per call more than the worker "
            f"reported; the champion's typical {typ:.3f} ms (bound {bound:.3f} ms): reported times do not match "
            "the judge's clock"
        )
    return None


class Stop(Exception):
    """Ends an evaluation with a status (raised by the driver, never by a worker)."""

    def __init__(self, status: Status, message: str, side: str = "candidate"):
        super().__init__(message)
        self.status, self.message, self.side = status, message, side


@dataclass
class Side:
    label: str  # "candidate" | "champion"
    worker: Worker
    buffer: JudgeBuffer
    samples: dict[int, list[float]] = field(default_factory=dict)
    events: dict[int, list[float]] = field(default_factory=dict)
    wall_ms: dict[int, float] = field(default_factory=dict)
    unexplained: dict[int, list[float]] = field(default_factory=dict)  # judge wall minus reported, per call
    checked: dict[int, list[float]] = field(default_factory=dict)  # the checked timed calls' own samples
    method: TimerMethod | None = None
    done: Done | None = None
    busy: bool = False  # a command sent, its reply not read yet (a worker in that state is not reused)
    ready: bool = False  # imported and warmed up (a reused champion's worker already is)


class Hard:
    """The session's end for one evaluation (a ``time.monotonic()`` instant), moved on by the time its waits spent
    behind another process measuring on the device, up to ``allowance`` seconds (what the session's budget leaves
    uncounted of such waits). A wait behind the session's own other evaluation does not move it: with two
    evaluations in flight on one device, the one that waited used to get the whole allowance on top of its timeout
    (a 60 s session ran 240 s on the CPU)."""

    def __init__(self, at: float, allowance: float = 0.0, foreign: Callable[[], float] | None = None):
        self.at = at
        self.allowance = max(allowance, 0.0)
        self.foreign = foreign
        self.foreign0 = foreign() if foreign is not None else 0.0

    def now(self) -> float:
        moved = 0.0
        if self.foreign is not None and self.allowance > 0:
            moved = min(max(self.foreign() - self.foreign0, 0.0), self.allowance)
        return self.at + moved


def wait_until(take: Callable[[float | None], Any], hard: Hard | None, poll_s: float = 2.0) -> Any:
    """``take(timeout)`` until it succeeds (anything but False, as the device lock's acquires return) or the
    (moving) ``hard`` instant passes: in slices, so that a wait behind another process that moves the instant on
    keeps waiting. False when it passes."""
    if hard is None:
        return take(None)
    while True:
        left = hard.now() - time.monotonic()
        got = take(max(min(left, poll_s), 0.0))
        if got is not False:
            return got
        if hard.now() - time.monotonic() <= 0:
            return False


class Clock:
    """The evaluation's time budget; time spent waiting for the GPU lock does not count against
    ``limit``. ``hard`` (the session's end, ``Hard``) bounds everything, waiting included, so that no
    evaluation outlives the session's budget by more than one candidate's timeout (and the waits behind other
    processes the budget does not count)."""

    def __init__(self, limit: float, hard: Hard | None = None):
        self.limit = limit
        self.started = time.monotonic()  # since when the time is the candidate's (a reset starts it again) ...
        self.not_charged = 0.0  # ... less what was excluded since
        self.deadline = self.started + limit
        self.hard = hard
        self.after = ""

    def left(self) -> float:
        end = self.deadline if self.hard is None else min(self.deadline, self.hard.now())
        return end - time.monotonic()

    def hard_left(self) -> float | None:
        return None if self.hard is None else self.hard.now() - time.monotonic()

    def expired(self) -> str:
        if self.hard is not None and self.hard.now() <= self.deadline:
            return "the session's time ran out (budget.minutes plus one candidate's timeout); worker killed"
        return f"no result within {self.limit:.0f} s{self.after} (hang or too slow); worker killed"

    def reset(self, limit: float, after: str) -> None:
        now = time.monotonic()
        if limit < self.deadline - now:
            self.limit, self.deadline, self.after = limit, now + limit, after
            self.started, self.not_charged = now, 0.0

    def charged(self) -> float:
        """Seconds of the candidate's own since the clock (re)started: waits and other work excluded."""
        return time.monotonic() - self.started - self.not_charged

    def excluded(self, seconds: float) -> None:
        """Time that was not the candidate's (a wait for the device, the champion's set-up): the deadline moves on."""
        self.deadline += seconds
        self.not_charged += seconds

    def extend(self, seconds: float, after: str) -> None:
        """An allowance on top of the limit (or its unused part taken back, ``seconds`` < 0), said if it expires."""
        if seconds:
            self.deadline += seconds
            self.after = after


# A checked timed call's outputs at least this share within the tolerance are a near miss (incorrect), not a hack
NEAR_MISS = 0.9
# ... and at least this share (below the near miss) is checked again on the same input set, untimed (``compare``):
# far-off outputs are a hack outright, whatever a second call does (a kernel that skips its work from some call on
# skips it there too, and would read incorrect)
RECHECKED = 0.5


def timed_calls(est_ms: float, target_ms: float, min_iters: int, max_iters: int) -> int:
    """Timed calls per side for a workload whose call takes about ``est_ms``: enough to fill
    ``target_ms``, at least ``min_iters``; but a call so slow that ``min_iters`` of them would cost
    more than four targets and more than a second gets two calls (at least two samples per side,
    interleaved as any): one reference of a problem that loops in Python over 2,000 steps takes
    seconds per call, and eight of them per side held the GPU from every other session for a minute.
    (``est_ms`` is the judge's clock per warm-up call, set-up included: without the second bound, a
    CPU test's 5 ms target made every burst a single call, whose fixed cost the judge-clock rule then
    read as a forged timer.)"""
    n = max(target_ms / est_ms, min_iters)
    if min_iters * est_ms > max(4 * target_ms, 1000.0):
        n = max(2.0, 4 * target_ms / est_ms)
    return int(min(n, max_iters))


def gpu_wait_message(waited: float) -> str:
    return (
        f"waited {waited:.0f} s for the GPU (another session or candidate was measuring on it) until the "
        "session's time ran out (budget.minutes plus one candidate's timeout)"
    )


class Driver:
    def __init__(self, guard: Any, clock: Clock, res: dict):
        self.g = guard
        self.cfg = guard.cfg
        self.clock = clock
        self.res = res
        self.holding = False
        self.shared: Any = None  # the shared lock's token while a warm-up holds it
        self.shared_since = 0.0
        self.champ_ref: dict[int, float] = {}  # the champion's latency per workload when it was crowned
        self.measured: list[int] = []  # the worker pids moved onto the quiet cores while the lock is held
        self.trusted = False  # the challenger is a trusted baseline (torch.compile of the reference): it cannot cheat
        self.baseline = False  # the challenger is the judge's own reference or its torch.compile, to the byte
        self.fresh: dict[int, bool] = {}  # per workload: its timed calls get whole new draws (Guard.fresh_inputs)

    # -- messages ------------------------------------------------------------------------
    def recv(self, side: Side, expect: type) -> Any:
        w = side.worker
        while True:
            if self.shared is not None and time.monotonic() - self.shared_since > self.cfg.warmup_lock_s:
                # a long compile (Inductor's max-autotune, a big Triton sweep) must not hold every timing back
                self.unlock_shared()
                log.debug("a warm-up of %s past guard.warmup_lock_s: shared device lock released", side.label)
            left = self.clock.left()
            if left <= 0:
                raise Stop(Status.timeout, self.clock.expired(), side.label)
            try:
                msg = w.chan.recv_message(min(left, 1.0))
            except TimeoutError:
                if not w.alive() and not w.chan.readable(0):
                    raise Stop(Status.runtime_error, self._died(w), side.label) from None
                continue
            except (EOFError, OSError):
                raise Stop(Status.runtime_error, self._died(w), side.label) from None
            except ProtocolError as e:
                raise Stop(Status.rejected_hack, f"worker sent an invalid message ({e})", side.label) from None
            if isinstance(msg, Fail):
                self.res["phases"].update(msg.phases)
                self.res["warnings"] += [
                    x for x in msg.warnings if x not in self.res["warnings"] and not x.startswith("sandbox:")
                ]
                raise Stop(Status(msg.status.value), msg.error, side.label)
            if not isinstance(msg, expect):
                raise Stop(
                    Status.rejected_hack,
                    f"protocol violation: expected {expect.__name__}, got {type(msg).__name__}",
                    side.label,
                )
            return msg

    @staticmethod
    def _died(w: Worker) -> str:
        with contextlib.suppress(Exception):
            w.process.wait(timeout=2)
        return (
            f"worker died (exit code {w.process.poll()}): the kernel crashed the process "
            "(illegal memory access, abort or segfault)"
        )

    def command(self, side: Side, cmd: Cmd, expect: type, meanwhile: tuple[int, int, bool] | None = None, **fields):
        """Send one command and wait for its reply; ``meanwhile=(wl, seed, hp)`` computes that reference (with its
        float64 run where ``hp``) in the judge while the worker works (only around untimed commands: it shares
        the device)."""
        t = time.perf_counter()
        side.busy = True
        try:
            side.worker.chan.send_command(cmd, **fields)
        except (OSError, TimeoutError):
            raise Stop(Status.runtime_error, self._died(side.worker), side.label) from None
        if meanwhile is not None:
            self.reference(*meanwhile)
        msg = self.recv(side, expect)
        side.busy = False
        dt = time.perf_counter() - t
        key = f"{side.label}.{cmd.value}"
        PROFILE[key] = PROFILE.get(key, 0.0) + dt
        if side.label == "champion" and side.ready:  # the challenger's worker reports its phases; the judge, these
            self.res["phases"]["champion"] = self.res["phases"].get("champion", 0.0) + dt
        return msg

    def reference(self, wl: int, seed: int, hp: bool = True) -> None:
        try:
            self.g.reference(wl, seed, hp)
        except Exception as e:  # noqa: BLE001 - the reference's failure is not the candidate's
            raise Stop(Status.runtime_error, f"reference failed on workload {wl}: {type(e).__name__}: {e}") from None

    # -- the evaluation ------------------------------------------------------------------
    def start(self, side: Side, job: dict, role: Role) -> None:
        if side.label != "champion":
            self.trusted = role is Role.trusted
        ident = side.worker.ident
        job = dict(job, role=role.value, uid=ident.uid, home=sandbox().homes[role], tmp=ident.tmp,
                   buffer=side.buffer.handle())  # fmt: skip
        side.worker.chan.send_command(Cmd.job, **job)

    def lock(self) -> None:
        if not self.holding:
            t = time.monotonic()
            if not wait_until(self.g._gpu.acquire, self.clock.hard):
                raise Stop(Status.timeout, gpu_wait_message(time.monotonic() - t))
            self.holding = True
            waited = time.monotonic() - t
            self.clock.excluded(waited)
            self.res["phases"]["gpu_wait"] = waited
            if self.g.quiet is not None and self.measured:
                self.g.quiet.enter(self.measured)

    def unlock(self) -> None:
        if self.holding:
            if self.g.quiet is not None and self.measured:
                self.g.quiet.leave(self.measured)
            self.g._gpu.release()
            self.holding = False

    def lock_shared(self) -> None:
        """The device lock shared, for a warm-up (none while this evaluation holds it exclusively, nor where
        ``guard.warmup_lock_s`` is 0); the time waited is not the candidate's."""
        if self.holding or self.shared is not None or self.cfg.warmup_lock_s <= 0:
            return
        t = time.monotonic()
        token = wait_until(lambda timeout: self.g._gpu.acquire_shared(timeout=timeout), self.clock.hard)
        waited = time.monotonic() - t
        if token is False:
            raise Stop(Status.timeout, gpu_wait_message(waited))
        self.clock.excluded(waited)
        self.res["phases"]["gpu_wait_warmup"] = self.res["phases"].get("gpu_wait_warmup", 0.0) + waited
        self.shared, self.shared_since = token, time.monotonic()

    def unlock_shared(self) -> None:
        token, self.shared = self.shared, None
        if token is not None:
            self.g._gpu.release_shared(token)

    def warm_up(self, side: Side, wl: int, seed: int) -> None:
        """One warm-up command (JIT compilation and first calls), its kernels never beside another's timing: the
        whole of it under the shared lock for up to ``guard.warmup_lock_s``, its GPU benchmarking for up to
        ``guard.bench_lock_s`` of waits in all (benchlock: not while this evaluation holds the lock itself). The
        deadline moves on by ``bench_lock_s`` while the worker may wait, and back by what it did not wait."""
        self.lock_shared()
        allow = self.cfg.bench_lock_s if self.cfg.bench_lock_s > 0 and not self.holding else 0.0
        fields = {"bench_lock": True} if allow else {}
        self.clock.excluded(allow)
        try:
            msg = self.command(side, Cmd.warmup, Ok, wl=wl, seed=seed, **fields)
        finally:
            self.unlock_shared()
        if allow:
            waited = min(msg.waited_s, allow)
            self.clock.excluded(waited - allow)
            self.res["phases"]["gpu_wait_bench"] = self.res["phases"].get("gpu_wait_bench", 0.0) + waited

    def setup_champion(self, champ: Side) -> None:
        """A new champion worker's import and warm-up (JIT compilation) on every workload, once for all the
        evaluations it serves; outside the per-GPU lock, as a challenger's."""
        self.recv(champ, Imported)  # (a worker left not ready by an exception here is never reused)
        warm_seed = secrets.randbits(62)
        for wl in self.g.workloads:
            self.warm_up(champ, wl, warm_seed)
        champ.ready = True

    def run(self, cand: Side, champ: Side | None, seeds: list[int], language: str, run_limit: float,
            compile_s: float = 0.0) -> None:  # fmt: skip
        """The challenger's evaluation once its worker is started: import (build), warm-up, checks, timing. After
        the build the plain ``run_limit`` applies; the warm-up of a candidate that compiles at its first calls
        (torch.compile; its import then loads the compiler too, under the judge's limit plus ``compile_s``) may
        take up to ``compile_s`` more, and what it leaves of that is taken back."""
        if champ is not None and not champ.ready:
            self.setup_champion(champ)
        msg = self.recv(cand, Imported)
        self.res["warnings"] += [n for n in msg.notes if not n.startswith("sandbox:")]
        self.clock.reset(run_limit + compile_s, " after its build")
        wls = self.g.workloads
        timed = self.cfg.timing
        # A CUTLASS candidate was built at import and has nothing to compile here, so it warms up
        # under the lock: a kernel of its that hangs then only delays the others, and never shares
        # the GPU with their timing. JIT languages compile outside the lock, and so does a CUTLASS
        # composition whose rest of the graph Inductor compiles at its first calls.
        if timed and language == "cutlass" and not compile_s:
            self.lock()
        warm_seed = secrets.randbits(62)
        for wl in wls:
            self.warm_up(cand, wl, warm_seed)
        # what the import and warm-up left of the allowance is not the checks' and timings'
        self.clock.extend(-max(compile_s - self.clock.charged(), 0.0), " after its build")
        if timed:
            self.lock()
        for wl in wls:
            for j, seed in enumerate(seeds):
                out = self.command(cand, Cmd.check, Outputs, (wl, seed, j == 0), wl=wl, seed=seed, keep=True)
                self.compare(cand, out, wl, seed, j)
                if champ:
                    # The champion times on the same sets; a reused worker drops the last evaluation's first.
                    self.command(champ, Cmd.prepare, Ok, wl=wl, seed=seed, fresh=j == 0)
            if len(seeds) >= 2:
                out = self.command(cand, Cmd.reuse, Outputs, wl=wl)
                self.compare(cand, out, wl, seeds[1], 1)
        self.res["checked"] = True  # every checked call of the challenger passed
        if not timed:
            return
        for i, wl in enumerate(wls):
            self.time_workload(wl, cand, champ, later=len(wls) - 1 - i)

    def compare(self, side: Side, msg: Outputs, wl: int, seed: int, j: int) -> None:
        if msg.wl != wl:
            raise Stop(Status.rejected_hack, f"outputs for workload {msg.wl} where {wl} was asked", side.label)
        if side.label == "champion":
            # The champion's checked timed calls: its own errors end its comparison (never the challenger's
            # verdict, nor the challenger's error metrics).
            why = self.wrong_aside(side, msg, wl, seed, j)
            if why is not None:
                raise Stop(Status.rejected_hack, f"workload {wl}: a champion output produced while timed is wrong "
                           f"({why[:500]})", side.label)  # fmt: skip
            return
        ok = self.g._check_outputs(side.buffer, msg, wl, seed, j, self.res)
        if ok:
            return
        if msg.tag is Tag.reuse:
            self.res["errors"].append("stale result after the inputs changed in place: outputs cached across calls")
            raise Stop(Status.rejected_hack, "")
        if msg.tag is Tag.timed:
            matched = self.res.get("failed_matched")  # None: a shape, dtype or layout that is wrong
            if self.trusted:  # L1/061 on the H200: torch.compile's one-element gradient sum off on one input set
                raise Stop(Status.incorrect, f"workload {wl}: an output produced while timed is outside the tolerance")
            if matched is not None and matched >= NEAR_MISS:
                # Most elements within the tolerance, and every check before passed: a kernel on the edge of the
                # tolerance, met by one input set and not by the next (L2/028 on the H200: a composed library
                # candidate, 98.7% of a gradient within a tolerance torch.compile missed too). Incorrect either
                # way; a kernel that skips work while timed is far off (stale or missing outputs match ~0%).
                raise Stop(Status.incorrect, f"workload {wl}: an output produced while timed is outside the "
                           f"tolerance ({matched:.1%} of elements within it; the checks before passed)")  # fmt: skip
            if matched is not None and matched >= RECHECKED:
                # Mostly right: the same input set again, in an untimed check. A kernel that skips or cheapens its
                # work while timed passes it (a hack); one wrong on these inputs whenever it runs fails it too
                # (incorrect: L2/028 on the H200, a composed rope candidate at 72% of a gradient within a
                # tolerance that torch.compile met on 73%, after three checked input sets had passed).
                again = self.untimed_again(side, wl, seed)
                if again is not None:
                    raise Stop(Status.incorrect, f"workload {wl}: an output produced while timed is outside the "
                               f"tolerance ({matched:.1%} of elements within it), and so is the same input set's "
                               f"untimed check ({again})")  # fmt: skip
                raise Stop(Status.rejected_hack, f"workload {wl}: an output produced while timed is wrong "
                           f"({matched:.1%} of elements within the tolerance); the same input set's untimed check "
                           "passes")  # fmt: skip
            # far off (stale, missing or garbage outputs: a kernel that stops working once the checks are over)
            raise Stop(Status.rejected_hack, f"workload {wl}: an output produced while timed is wrong")
        raise Stop(Status.incorrect, "")

    def untimed_again(self, side: Side, wl: int, seed: int) -> str | None:
        """The challenger's checked call on a checked timed call's input set (``seed``), untimed: None where its
        outputs are within the tolerance, else what is wrong with them."""
        msg = self.command(side, Cmd.check, Outputs, wl=wl, seed=seed, keep=False)
        if msg.wl != wl or msg.tag is not Tag.check:
            raise Stop(Status.rejected_hack, f"outputs for workload {msg.wl} ({msg.tag.value}) where workload {wl}'s "
                       "check was asked", side.label)  # fmt: skip
        why = self.wrong_aside(side, msg, wl, seed, 1)
        return None if why is None else why[:300] or "outputs wrong"

    def wrong_aside(self, side: Side, msg: Outputs, wl: int, seed: int, j: int) -> str | None:
        """What is wrong with ``msg``'s outputs (None: within the tolerance), checked beside the verdict: their errors
        and error metrics are not the challenger's record (a champion's checked timed call, a second look)."""
        scratch: dict[str, Any] = {"errors": [], "checks": {}}
        if self.g._check_outputs(side.buffer, msg, wl, seed, j, scratch):
            return None
        return "; ".join(scratch["errors"])

    def burst(self, side: Side, wl: int, n: int, check_seed: int | None = None) -> Timing:
        if check_seed is not None:
            self.command(side, Cmd.stage, Ok, (wl, check_seed, False), wl=wl, seed=check_seed)
        t = time.perf_counter()
        # which call of the burst is checked: the judge's secret, so that a kernel counting its calls
        # cannot do the work only on the checked one
        at = secrets.randbelow(n) if check_seed is not None else None
        msg = self.command(side, Cmd.time, Timing, wl=wl, n=n, check=check_seed is not None, check_at=at,
                           fresh=self.fresh.get(wl, False))  # fmt: skip
        wall = (time.perf_counter() - t) * 1e3
        if msg.wl != wl or (check_seed is not None) != (msg.check is not None):
            raise Stop(Status.rejected_hack, "timing reply does not match the burst asked for", side.label)
        if side.method is None:
            side.method = msg.method
        elif msg.method is not side.method and msg.method is not TimerMethod.events:
            raise Stop(Status.rejected_hack, "timing method changed between bursts", side.label)
        elif msg.method is not side.method:
            note = f"timing: CUPTI stopped in the {side.label}'s worker (workload {wl}): CUDA events from then on"
            if note not in self.res["warnings"]:
                self.res["warnings"].append(note)
        side.wall_ms[wl] = side.wall_ms.get(wl, 0.0) + wall
        if at is not None and len(msg.samples_ms) == n:
            side.checked.setdefault(wl, []).append(msg.samples_ms[at])
        if side.label != "champion" or check_seed is None:
            # A checked burst's time includes the copy of its outputs and their check: the champion's typical
            # unexplained time (the judge-clock rule's yardstick) is taken from its plain bursts only.
            side.unexplained.setdefault(wl, []).append(max(wall - sum(msg.samples_ms), 0.0) / len(msg.samples_ms))
        if check_seed is not None and msg.check is not None:
            self.compare(side, msg.check, wl, check_seed, -1)
        return msg

    def time_workload(self, wl: int, cand: Side, champ: Side | None, later: int = 0) -> None:
        """Time one workload, both sides interleaved; timed again (``cfg.retimes`` times at most) where the champion
        ran more than the consistency factor slower than when it was crowned, which would void the comparison.
        On one GPU shared by several sessions, another process's kernels (a warm-up's, outside the device lock)
        time-slice with the measured ones for a while: 11-15% of the H200 suite's comparisons were void for it. A
        second timing, a moment later, is mostly clear of it; a champion that stays slow (a challenger that slows
        it, a worker gone bad) is as slow again, and the comparison stays void (the decision reapplies the rule
        to the champion's last timing against its crowned latency, never against a re-timed one).

        Every timing passes the integrity checks on its own (``cross_check``: a timer forged in one timing only is
        caught there). The champion is judged on its last timing; the challenger on all of its timings pooled, so
        that a timing of its own that went badly is no re-roll for it: where its process slowed the champion, its
        earlier samples stay in its median. A workload whose apparent gain is inside its noise is timed again
        too (``undecided``, once, with its own allowance), its samples replaced on both sides. A timing that breaks the
        judge-clock rule (``clock_check``) is timed again once, its samples dropped on both sides, and a second break
        rejects: on a CI host's two cores, two evaluations in flight beside a pool starting workers once broke it
        for an honest challenger (the reference's own code). ``later``: the workloads still to time in this
        evaluation, whose time a retime must leave."""
        kept: tuple[list[float], list[float]] = ([], [])
        left = {
            "inconsistent": max(self.cfg.retimes, 0),
            "undecided": min(max(self.cfg.retimes, 0), 1),
            "clock": 1,
            "skipped": 1,
        }
        attempt = 0
        while True:
            t = time.monotonic()
            self.time_rounds(wl, cand, champ)
            self.cross_check(wl, cand, champ)
            took = time.monotonic() - t
            # another timing only while the clock leaves room for it and one timing of each workload still to come
            room = self.clock.left() >= took * (2 + later) + 2.0
            why, trigger = self.clock_check(wl, cand, champ), "clock"
            if why is not None and self.baseline:
                # The judge's own code forges no timer: what its clock sees outside the kernels' span is host work
                # (L2/008 on the H100: torch.compile of the reference spent ~96 ms a call outside a 30 ms kernel
                # span, recompiling or waiting on host reads; rejected as a hack, it left the problem without a
                # torch.compile figure). Its span is compared as any other side's, as NVIDIA's harness times it.
                note = f"workload {wl}: {why}; a baseline: its kernels' span is compared, its host time is not"
                if note not in self.res["warnings"]:
                    self.res["warnings"].append(note)
                why = None
            if why is not None and (not left["clock"] or not room):
                raise Stop(Status.rejected_hack, f"workload {wl}: {why}")
            if why is None and not self.baseline:
                why, trigger = self.skipped_work(wl, cand), "skipped"
                if why is not None and (not left["skipped"] or not room):
                    raise Stop(Status.rejected_hack, f"workload {wl}: {why}")
            if why is None:
                why, trigger = self.inconsistent(wl, cand, champ), "inconsistent"
            if why is None:
                why, trigger = self.undecided(wl, cand, champ), "undecided"
            if why is None or not left[trigger] or not room:
                break
            left[trigger] -= 1
            attempt += 1
            self.res["warnings"].append(f"workload {wl} timed again: {why}")
            if trigger == "inconsistent":
                kept[0].extend(cand.samples.get(wl, []))
                kept[1].extend(cand.events.get(wl, []))
            for s in (cand, champ):
                for per_wl in (s.samples, s.events, s.wall_ms, s.unexplained, s.checked):
                    per_wl.pop(wl, None)
            time.sleep(0.25 * attempt)
        if kept[0]:
            cand.samples[wl] = kept[0] + cand.samples.get(wl, [])
        if kept[1]:
            cand.events[wl] = kept[1] + cand.events.get(wl, [])

    def skipped_work(self, wl: int, cand: Side) -> str | None:
        """Why the challenger's checked timed calls say it skips work on the others (None: they do not). A checked
        call's inputs are a set the judge drew just before the burst; where the other calls' inputs repeat a content
        (a problem whose inputs all come from its own ``get_inputs`` and cost too much to draw before every call, or
        the inputs that keep their content: masks, tables, files), a result kept by content pays on those calls
        only, and the checked calls, which always pay in full, stand out: the red team's c02 (a memo keyed on
        sampled elements, L1/008) was crowned so. Every checked call (``timed_checks`` a timing) slower than
        ``skip_factor`` times the median of all the timed calls, beyond the slack, is the sign: an honest kernel's
        checked calls run as the others do (the same buffers, the same cache flush, inputs from the same draw).
        Interference that slows both checked calls of a timing and not its median passes on the second timing."""
        chk, every = cand.checked.get(wl), cand.samples.get(wl)
        if not chk or not every or len(every) < len(chk) + 3:
            return None
        lo, med = min(chk), median(every)
        slack = self.cfg.clock_slack_ms * (0.1 if self.g.device.startswith("cuda") else 1)
        if lo <= med * self.cfg.skip_factor + slack:
            return None
        return (f"its {len(chk)} checked timed call(s), whose inputs are new, took {lo:.4g} ms or more, "
                f"{lo / max(med, 1e-9):.3g}x the median of its timed calls ({med:.4g} ms): work skipped on "
                "inputs seen before")  # fmt: skip

    def undecided(self, wl: int, cand: Side, champ: Side | None) -> str | None:
        """Why this workload's timing cannot tell a gain from noise (None: it can, or there is no gain to tell): the
        challenger's median at least ``UNDECIDED_GAIN`` times faster than the champion's, but inside this workload's
        own noise bar. On the H200 suite torch.compile ran 2.4-243x faster than a champion by the medians and stayed
        correct_slower, its samples spread wider still (time-sliced with another process's kernels). Timed again,
        both sides' samples are replaced: interference only ever inflates a sample, and the decision still needs
        the new timing's ratio past the new timing's bar."""
        if champ is None or not self.champ_ref or not cand.samples.get(wl) or not champ.samples.get(wl):
            return None  # (without a crowned latency, e.g. the final side by side, nothing checks the champion)
        if median(cand.samples[wl]) <= 0:
            return None
        ratio = median(champ.samples[wl]) / median(cand.samples[wl])
        noise = workload_noise(cand.samples[wl], champ.samples[wl])
        bar = noise_bar(noise, self.cfg.min_gain, self.cfg.noise_factor)
        if ratio < UNDECIDED_GAIN or ratio > bar:  # a tie is not timed again: more draws would only favour it
            return None
        return f"{ratio:.3g}x faster by the medians, inside the noise ({noise:.2f} relative spread: {bar:.3g}x needed)"

    def inconsistent(self, wl: int, cand: Side, champ: Side | None) -> str | None:
        """Why this workload's comparison would be void (None: it would not, or timing it again could not help:
        a challenger no faster than the slowed champion is no faster than a champion at its crowned speed)."""
        # past the plain factor, trusted baselines too: the slack only decides what is void (Y's L1/072: torch.compile
        # crowned, slower than the reference alone, while the reference ran 2x its crowned time)
        if champ is None:
            return None
        ref = self.champ_ref.get(wl)
        now = slowed_champion(champ.samples.get(wl, []), ref, self.cfg.consistency_factor)
        if now is None or not cand.samples.get(wl) or median(cand.samples[wl]) >= now:
            return None
        return f"the champion measured {now:.4g} ms beside the challenger vs {ref:.4g} ms when crowned"

    def time_rounds(self, wl: int, cand: Side, champ: Side | None) -> None:
        cfg = self.cfg
        sides = [cand] + ([champ] if champ else [])
        n_for: dict[str, int] = {}
        self.fresh[wl] = self.g.fresh_inputs(wl)  # asked once: the same for both sides and every burst of the timing
        if not self.fresh[wl] and (why := self.g.stale_inputs(wl)):
            note = f"workload {wl}: {why}"
            if note not in self.res["warnings"]:
                self.res["warnings"].append(note)
        for s in sides:
            t = time.perf_counter()
            # The warm-up time is shared by the sides, as when both ran in one worker.
            msg = self.command(s, Cmd.time, Timing, wl=wl, n=0, warm=True, warm_ms=cfg.warmup_ms / len(sides),
                               fresh=self.fresh[wl])  # fmt: skip
            wall = (time.perf_counter() - t) * 1e3
            est = max(wall / max(len(msg.samples_ms), 1), 1e-3)  # the judge's clock, not the worker's word
            if self.fresh[wl] and (drawn := self.g.draw_s(wl)):
                # a new draw before every call is set-up, not the kernel's time: left out of the estimate (its
                # cheapest time, the judge's own measure), up to four times the calls the wall time alone gives (a
                # 4 ms draw had left a 50 ms target six calls a side)
                est = max(est - drawn * 1e3, est / 4, 1e-3)
            # The timed time is shared by the sides too, as when both ran in one worker (before round 2):
            # each side gets about as many samples as then.
            n_for[s.label] = timed_calls(est, cfg.target_ms / len(sides), cfg.min_iters, cfg.max_iters)
            if s is cand and msg.excess_ms is not None:
                med = median(msg.samples_ms)
                if msg.excess_ms > max(20.0, 10 * med):
                    raise Stop(
                        Status.rejected_hack,
                        f"workload {wl}: {msg.excess_ms:.2f} ms of device work outlives the timed region "
                        f"(median event time {med:.3f} ms): side stream or deferred work",
                    )
        # Both sides get the same calls per burst (the slower side's count): the judge-clock rule holds the
        # challenger's unexplained time per call against the champion's, and a burst's fixed cost (the command's
        # round trip, the integrity checks after it) spread over fewer calls on one side only would read as a
        # forged timer. On the CPU an interpreted Triton kernel (3 calls a burst) was rejected so beside the
        # reference (20 calls a burst).
        n_all = min(n_for.values())
        n_for = dict.fromkeys(n_for, n_all)
        rounds = max(1, min(cfg.rounds, n_all))
        rng = secrets.SystemRandom()
        checked = {
            cand.label: set(rng.sample(range(rounds), k=min(cfg.timed_checks, rounds))),
            "champion": set(rng.sample(range(rounds), k=min(max(cfg.champion_checks, 0), rounds))),
        }
        for r in range(rounds):
            order = sides if r % 2 == 0 else sides[::-1]
            for s in order:
                n = -(-n_for[s.label] // rounds)  # ceil: min_iters holds over the rounds
                seed = secrets.randbits(62) if r in checked[s.label] else None
                msg = self.burst(s, wl, n, seed)
                s.samples.setdefault(wl, []).extend(msg.samples_ms)
                if msg.events_ms:
                    s.events.setdefault(wl, []).extend(msg.events_ms)

    def cross_check(self, wl: int, cand: Side, champ: Side | None) -> None:
        if champ is not None and cand.method is not None and champ.method is not None and cand.method != champ.method:
            # One side's worker fell back from CUPTI to CUDA events (whose spans are a few us longer): the two
            # would be timed by different clocks, which alone can look like a gain on short kernels.
            raise Stop(
                Status.runtime_error,
                f"timers differ (challenger {cand.method.value}, champion {champ.method.value}): not compared",
                "champion",
            )
        for s in [cand] + ([champ] if champ else []):
            if s.method is TimerMethod.cupti and s.events.get(wl):
                cu, ev = median(s.samples[wl]), median(s.events[wl])
                if cu > ev * 1.2 + 0.02:
                    raise Stop(
                        Status.rejected_hack,
                        f"workload {wl}: CUPTI kernel span {cu:.4f} ms exceeds the CUDA event span {ev:.4f} ms: "
                        "device work runs past the timed region (side stream or deferred work)",
                        s.label,
                    )
        claimed = sum(cand.samples[wl])
        wall = cand.wall_ms[wl]
        if claimed > wall * 1.05 + 1.0:
            raise Stop(
                Status.rejected_hack, f"workload {wl}: reported {claimed:.2f} ms inside {wall:.2f} ms of wall time"
            )

    def clock_check(self, wl: int, cand: Side, champ: Side | None) -> str | None:
        """The judge-clock rule on this timing (None: it holds). Kept apart from ``cross_check``: the host's load
        can break it for one timing (a worker start importing torch on both cores, another evaluation's thread
        holding the judge's interpreter), so ``time_workload`` times such a workload once more before it rejects;
        a forged timer is forged in the second timing too."""
        if champ is None or not champ.unexplained.get(wl) or not cand.unexplained.get(wl):
            return None
        slack = self.cfg.clock_slack_ms * (1 if self.g.device.startswith("cuda") else 25)
        msg = clock_violation(cand.unexplained[wl], champ.unexplained[wl], median(champ.samples[wl]),
                              self.cfg.clock_factor, slack)  # fmt: skip
        return f"{msg} (reported median {median(cand.samples[wl]):.3f} ms)" if msg else None

    def finish(self, sides: list[Side]) -> None:
        for s in sides:
            s.done = self.command(s, Cmd.end, Done)

    def champion_clean(self, champ: Side) -> None:
        """After every evaluation a champion's worker served: no process of its identity but the worker itself
        (what ``Cmd.end`` checks in a worker that ends; this one goes on serving): a daemon would outlive the
        evaluation and share the host and device with the next challenger's timing."""
        w = champ.worker
        strays = [p for p in find_processes(w.ident, w.process.pid, w.since, os.getpid()) if p != w.process.pid]
        if strays:
            raise Stop(Status.rejected_hack, f"champion worker left {len(strays)} process(es) running", champ.label)
