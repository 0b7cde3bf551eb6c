"""Memory model per workload: what the guard may hold on one device so that nothing runs out of memory
wherever the reference alone fits.

The guard holds, per device:
- in the judge: the reference outputs it caches (and their float64 twins, for the ``rel_err`` metric), one
  reference call's working memory, the candidate's outputs it received and the comparison's float32
  temporaries;
- in each worker: every rotating input set with the outputs checked on it (per workload and seed, kept
  until timing), one more input set and output (the pristine copy, the in-place reuse check, the staged set
  of a checked burst), a candidate call's working memory (taken as the reference's), the L2 flush buffer and a
  CUDA context. Workers are the challengers in flight and the champion's, which holds sets of its own while it
  is timed beside each of them (and between evaluations, when it is reused).

Sizes come from the definition (input and output bytes from shapes and dtypes) and from a dry run of the
reference (peak allocation above its inputs: ``torch.cuda.max_memory_allocated`` on a GPU; on the CPU the
output sizes, as torch's CPU allocator reports no peak). The plan then bounds the seeds (input sets per
workload), the judge's reference cache, the float64 reference and the workers per device, and gives a
verdict with its cause for each workload that cannot run even so.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from kernelarc.guard.compare import CHUNK
from kernelarc.tasks.inputs import JITTER_OFF, all_custom, jitter_changes, make_inputs, torch_dtype
from kernelarc.tasks.loader import Task

log = logging.getLogger(__name__)

GB = 1 << 30
# Share of the cap the plan fills: the caching allocator's fragmentation and rounding need the rest.
HEADROOM = 0.9
# A dry run out of memory under its cap names a need this many times the cap's usable memory (a lower bound).
OVER_CAP_GROWTH = 2
# How a dry run out of memory under its own cap words it (the suite tells it from an allocation that other processes'
# memory refused by these words: ``kernelarc.suite.ran_out_beside_others``)
WITHIN_CAP = "within the cap"
# A CUDA context (plus torch's kernels) per worker process, resident whatever the workload.
CUDA_CONTEXT_BYTES = 600 << 20
# float32 temporaries of one comparison per output element: both sides, |diff|, the bound, masks.
COMPARE_BYTES_PER_ELEMENT = 18


@dataclass
class Footprint:
    """One workload's sizes in bytes."""

    index: int
    input_bytes: int
    output_bytes: int
    output_elements: int
    peak_bytes: int  # one reference call's allocations above its inputs (outputs included)
    measured: bool = False  # peak from a dry run on the device (else: the output bytes)
    error: str | None = None  # the dry run failed (out of memory, ...)
    unrun: bool = False  # its inputs and outputs alone are above the cap: not run (peak_bytes: the outputs only)
    over_cap: bool = False  # the dry run ran out of memory under the cap's bound (its need is above the cap)
    draw_s: float | None = None  # one draw of a get_inputs problem's inputs, timed alone under the device lock

    @property
    def hp_output_bytes(self) -> int:
        return self.output_elements * 8


@dataclass
class MemoryPlan:
    """What the guard may hold on one device (see the module docstring)."""

    device: str
    cap_bytes: int
    footprints: dict[int, Footprint]
    seeds: int = 1
    ref_cache_entries: int = 1
    hp_reference: bool = False
    max_workers: int = 1
    need_bytes: int = 0  # the plan's total at max_workers
    verdicts: dict[int, str] = field(default_factory=dict)  # workload -> why it cannot run
    notes: list[str] = field(default_factory=list)  # what the plan reduced, and why
    redraw: set[int] = field(default_factory=set)  # workloads with room for a new draw before every timed call

    @property
    def runnable(self) -> list[int]:
        return [i for i in self.footprints if i not in self.verdicts]

    def errors(self) -> list[str]:
        return [f"workload {i}: {why}" for i, why in sorted(self.verdicts.items())]

    def warnings(self) -> list[str]:
        return [f"workload {i} not run: {why}" for i, why in sorted(self.verdicts.items())] + self.notes


_NEEDS = re.compile(r"the guard needs ([0-9.]+) GB for one input set")


def cap_needed_gb(reason: str | None) -> float | None:
    """The ``guard.memory_gb`` at which every workload that ``reason`` (a plan's errors, as a failed session
    reports them) refused for memory would fit one input set: the largest need over the plan's headroom, plus
    5% for rounding; None when the reason names no such need (a dry run out of memory, another failure)."""
    needs = [float(m) for m in _NEEDS.findall(reason or "")]
    return math.ceil(max(needs) / HEADROOM * 1.05 * 10) / 10 if needs else None


def device_memory_bytes(device: str) -> int:
    """The device's memory: the GPU's total, or the machine's physical memory for the CPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return int(torch.cuda.get_device_properties(dev).total_memory)
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 16 * GB


def io_sizes(task: Task, index: int) -> tuple[int, int, int]:
    """(input bytes, output bytes, output elements) of a workload, from the definition's shapes and dtypes."""

    def size(specs: dict) -> tuple[int, int]:
        nbytes = elems = 0
        for name, spec in specs.items():
            shape = task.shape(name, index)
            if shape is None:
                continue
            n = math.prod(shape)
            elems += n
            nbytes += n * torch_dtype(spec.dtype).itemsize
        return nbytes, elems

    in_b, _ = size(task.definition.inputs)
    out_b, out_n = size(task.definition.outputs)
    return in_b, out_b, out_n


def _tensor_bytes(values: Any) -> int:
    if isinstance(values, torch.Tensor):
        return values.untyped_storage().nbytes()
    if isinstance(values, tuple | list):
        return sum(_tensor_bytes(v) for v in values)
    if isinstance(values, dict):
        return sum(_tensor_bytes(v) for v in values.values())
    return 0


@contextlib.contextmanager
def _bounded(dev: torch.device, cap_bytes: int) -> Iterator[bool]:
    """Within it, this process's caching allocator refuses to reserve more than it holds now plus ``cap_bytes``
    (``torch.cuda.set_per_process_memory_fraction``); yields whether that bound is below the whole device."""
    torch.cuda.empty_cache()
    total = int(torch.cuda.get_device_properties(dev).total_memory)
    get = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.9
    before = float(get(dev)) if get is not None else 1.0
    fraction = min(before, (int(torch.cuda.memory_reserved(dev)) + cap_bytes) / total)
    try:
        torch.cuda.set_per_process_memory_fraction(fraction, dev)
    except (RuntimeError, ValueError) as e:  # an allocator without the bound (a custom one): probe unbounded
        log.warning("memory probe not bounded by its cap: %s", e)
        yield False
        return
    try:
        yield fraction < 1.0
    finally:
        torch.cuda.set_per_process_memory_fraction(before, dev)


def dry_run(task: Task, index: int, device: str, run: Callable[..., Any], cap_bytes: int | None = None) -> Footprint:
    """A footprint with the reference's peak measured by running it once (seed 0).

    On a GPU the run is bounded by ``cap_bytes``: processes that share one GPU plan their shares from these
    probes, and an unbounded probe took what the others had planned (run DT, H100: a judge held 46.7 GB under
    an 11 GB share while probing, and another shard's reservation then ran out). A probe out of memory under
    the bound sets ``over_cap``: the plan names a need above the cap, which a suite's memory pool runs it
    again with."""
    in_b, out_b, out_n = io_sizes(task, index)
    fp = Footprint(index, in_b, out_b, out_n, peak_bytes=out_b)
    if cap_bytes is not None and in_b + out_b > cap_bytes:
        fp.error = (
            f"its inputs and outputs alone take {(in_b + out_b) / GB:.2f} GB, above the cap {cap_bytes / GB:.2f} GB"
        )
        fp.unrun = True
        return fp
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    bounded = False
    try:
        with contextlib.ExitStack() as stack:
            if cuda:
                torch.cuda.synchronize(dev)
                if cap_bytes is not None:
                    bounded = stack.enter_context(_bounded(dev, cap_bytes))
                torch.cuda.reset_peak_memory_stats(dev)
            inputs = make_inputs(task, index, 0, dev)
            base = torch.cuda.memory_allocated(dev) if cuda else 0
            out = run(*inputs)
            if cuda:
                torch.cuda.synchronize(dev)
                fp.peak_bytes = max(int(torch.cuda.max_memory_allocated(dev)) - base, _tensor_bytes(out))
                fp.measured = True
            else:
                fp.peak_bytes = max(_tensor_bytes(out), out_b)
            finite = _finite(out)
            del out, inputs
            if all_custom(task):
                if jitter_changes(task, index, dev) and not _takes_jitter(task, index, dev, run, finite):
                    JITTER_OFF.add(str(task.path))
                    log.warning("%s: the reference fails on scaled inputs: its draws stay as get_inputs makes them",
                                getattr(task, "name", "task"))  # fmt: skip
                # what a new draw before every timed call would cost (Guard.fresh_inputs): timed here, where nothing
                # else of this process runs on the device (the judge's own draws share it with evaluations in
                # flight, and read 28 ms for a 0.23 ms draw of L1/008 on a busy H100)
                t = time.perf_counter()
                again = make_inputs(task, index, 0, dev)
                if cuda:
                    torch.cuda.synchronize(dev)
                fp.draw_s = time.perf_counter() - t
                del again
    except Exception as e:  # noqa: BLE001 - a failing reference is a verdict, never a traceback
        oom = isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()
        fp.over_cap = oom and bounded
        where = f" {WITHIN_CAP}'s {cap_bytes / GB:.2f} GB" if fp.over_cap and cap_bytes is not None else ""
        fp.error = (f"the reference alone runs out of memory{where}" if oom else "the reference fails") + (
            f": {type(e).__name__}: {str(e)[:300]}"
        )
    finally:
        if cuda:
            torch.cuda.empty_cache()
    return fp


def _finite(out: Any) -> list[bool]:
    outs = list(out) if isinstance(out, tuple | list) else [out]
    return [bool(torch.isfinite(o).all()) if isinstance(o, torch.Tensor) and o.is_floating_point() else True
            for o in outs]  # fmt: skip


def _takes_jitter(task: Any, index: int, dev: torch.device, run: Callable[..., Any], finite: list[bool]) -> bool:
    """Whether the reference runs on a draw scaled off the problem's own (seed 1: a non-sol distribution) and keeps
    finite every output it kept finite on the problem's own draw."""
    try:
        inputs = make_inputs(task, index, 1, dev)
        got = _finite(run(*inputs))
    except Exception:  # noqa: BLE001 - any failure: the draws stay the problem's own
        return False
    return len(got) == len(finite) and all(g or not f for g, f in zip(got, finite, strict=True))


def _worker_bytes(fps: list[Footprint], seeds: int, cuda: bool, flush_bytes: int) -> int:
    """One worker's peak: every rotating set with the outputs checked on it (kept until timing), the pristine
    copy of the set being checked and a call's working memory beyond its outputs; with two seeds or more also
    the in-place reuse check's snapshot and outputs."""
    if not fps:
        return 0
    held = sum(seeds * (f.input_bytes + f.output_bytes) for f in fps)
    call = max(f.input_bytes + max(f.peak_bytes - f.output_bytes, 0) for f in fps)
    reuse = max(f.input_bytes + f.output_bytes for f in fps) if seeds >= 2 else 0
    return held + call + reuse + (flush_bytes + CUDA_CONTEXT_BYTES if cuda else 0)


def _champion_bytes(fps: list[Footprint], seeds: int, cuda: bool, flush_bytes: int) -> int:
    """The champion's worker beside a challenger, its CUDA context left out: its own timing sets (inputs only:
    it is never checked on them), and a staged set with one call's outputs and working memory."""
    if not fps:
        return 0
    held = sum(seeds * f.input_bytes for f in fps)
    call = max(f.input_bytes + max(f.peak_bytes, f.output_bytes) for f in fps)
    return held + call + (flush_bytes if cuda else 0)


def _judge_fixed(fps: list[Footprint], hp: bool) -> int:
    """The judge beside its cache, at its peak: a reference call (with its float64 run), or a received output
    and its comparison (chunked: bounded float32 temporaries; the float64 rel_err metric is not chunked)."""
    call = max(f.peak_bytes + f.input_bytes + (4 * (f.peak_bytes + f.input_bytes) if hp else 0) for f in fps)
    compare = max(
        2 * f.output_bytes
        + COMPARE_BYTES_PER_ELEMENT * min(f.output_elements, CHUNK)
        + (3 * f.hp_output_bytes if hp else 0)
        for f in fps
    )
    return max(call, compare)


def _entry(f: Footprint, hp: bool) -> int:
    return f.output_bytes + (f.hp_output_bytes if hp else 0)


def plan_memory(
    task: Task,
    workloads: list[int],
    device: str,
    *,
    memory_gb: float | None = None,
    seeds: int = 3,
    seed_pool: int = 8,
    parallel: int = 3,
    prestart: int = 2,
    hp_reference: bool = True,
    flush_bytes: int = 256 << 20,
    run: Callable[..., Any] | None = None,
    footprints: dict[int, Footprint] | None = None,
    champion: bool = True,
    fresh_inputs_ms: float = 25.0,
) -> MemoryPlan:
    """Bound seeds, reference cache, float64 reference and workers per device by the memory cap.

    ``memory_gb`` caps the device (null: its whole memory); ``run`` is the reference, dry-run once per workload
    unless ``footprints`` are given. More seeds come first, then more workers, then the float64 reference,
    then a larger cache. ``champion``: the champion's worker (one, shared by the evaluations in flight), timed
    beside the challengers, holds timing sets of its own (its CUDA context is one of the ``prestart`` ones). Left
    out, L2/024 on the H100 (12 GB per input set) was planned at 41 GB of workers and ran out of memory beside
    its champion.
    """
    cap = int((memory_gb * GB) if memory_gb is not None else device_memory_bytes(device))
    usable = int(cap * HEADROOM)
    cuda = torch.device(device).type == "cuda"
    flush = flush_bytes if cuda else 0
    ctx = CUDA_CONTEXT_BYTES if cuda else 0

    # a problem whose inputs all come from its own get_inputs has them drawn again, whole, before its timed calls
    # where a draw is cheap (the worker's _redraw, Guard.fresh_inputs): a transient input set more in every worker,
    # challenger and champion. Those workloads are in ``redraw``; one that would not run with it runs without it.
    redraw: set[int] = set()

    def in_workers(fl: list[Footprint], s: int, n: int) -> int:
        """``n`` challengers' workers and the champion's (its context counted with the resident ones)."""
        extra = max((f.input_bytes for f in fl if f.index in redraw), default=0)
        return n * (_worker_bytes(fl, s, cuda, flush) + extra) + (
            _champion_bytes(fl, s, cuda, flush) + extra if champion else 0
        )

    if footprints is None:
        footprints = {}
        for i in workloads:
            if run is None:
                in_b, out_b, out_n = io_sizes(task, i)
                footprints[i] = Footprint(i, in_b, out_b, out_n, out_b)
            else:
                footprints[i] = dry_run(task, i, device, run, usable)
    plan = MemoryPlan(device, cap, dict(footprints))
    name = getattr(task, "name", "task")
    if fresh_inputs_ms > 0 and all_custom(task):
        redraw |= {i for i, f in footprints.items() if f.draw_s is None or f.draw_s * 1e3 <= fresh_inputs_ms}
    for i, f in footprints.items():
        contexts = max(prestart, 0) * ctx
        need = in_workers([f], 1, 1) + _judge_fixed([f], False) + _entry(f, False) + contexts
        if i in redraw and not f.error and need > usable:
            redraw.discard(i)  # runs without new draws rather than not at all
            plan.notes.append(f"memory: workload {i}'s timed calls repeat one content (no room for a new draw)")
            need = in_workers([f], 1, 1) + _judge_fixed([f], False) + _entry(f, False) + contexts
        if f.error:
            log.warning("%s: workload %d: %s", name, i, f.error)
            plan.verdicts[i] = f"{f.error} (memory cap {cap / GB:.2f} GB on {device})"
            if f.unrun:
                # what one input set needs with the reference's working memory left out (it was not run): a
                # lower bound that a suite's memory pool can run it again with (cap_needed_gb); that run
                # measures the reference and names the whole need if the bound falls short
                plan.verdicts[i] += f"; the guard needs {need / GB:.2f} GB for one input set at least"
            elif f.over_cap:
                # out of memory under the bound: the need is above the cap, by how much is unknown; twice the
                # usable memory makes a suite's retries grow geometrically (cap_needed_gb), each run probing again
                lower = max(need, OVER_CAP_GROWTH * usable)
                plan.verdicts[i] += f"; the guard needs {lower / GB:.2f} GB for one input set at least"
            continue
        if need > usable:
            beside_words = ", and the champion's worker beside it" if champion else ""
            plan.verdicts[i] = (
                f"the reference fits ({(f.peak_bytes + f.input_bytes) / GB:.2f} GB) but the guard needs "
                f"{need / GB:.2f} GB for one input set (reference outputs in the judge; a candidate's inputs, "
                f"outputs and working memory in its worker{beside_words}), above {usable / GB:.2f} GB usable of the "
                f"{cap / GB:.2f} GB cap on {device}"
            )
            log.warning("%s: workload %d not run: %s", name, i, plan.verdicts[i])
    fps = [footprints[i] for i in plan.runnable]

    def total(s: int, hp: bool, workers: int, entries: int) -> int:
        biggest = max(_entry(f, hp) for f in fps)
        return _judge_fixed(fps, hp) + entries * biggest + in_workers(fps, s, workers) + max(prestart, 0) * ctx

    choice = None
    while fps and choice is None:
        n = len(fps)
        for s in range(max(seeds, 1), 0, -1):
            if total(s, False, 1, s * n) <= usable:
                choice = (s, False)
                break
        if choice is None and redraw & {f.index for f in fps}:
            # new draws before the timed calls go before any workload does
            plan.notes.append("memory: timed calls repeat one content (no room for new draws beside every workload)")
            redraw.clear()
            continue
        if choice is None:
            # Each fits alone, not all at once (a worker keeps every workload's input sets until timing):
            # the largest goes, with its verdict, so that the others run.
            f = max(fps, key=lambda f: in_workers([f], 1, 1) + _judge_fixed([f], False))
            plan.verdicts[f.index] = (
                f"fits alone but not beside the other workloads within {usable / GB:.2f} GB usable of the "
                f"{cap / GB:.2f} GB cap on {device} (a worker keeps every workload's input sets until timing)"
            )
            log.warning("%s: workload %d not run: %s", name, f.index, plan.verdicts[f.index])
            fps.remove(f)
    if choice is None:
        return plan
    n = len(fps)
    s, hp = choice
    workers = 1
    while workers < max(parallel, 1) and total(s, hp, workers + 1, s * n) <= usable:
        workers += 1
    # The float64 run feeds a metric only (rel_err): it comes after seeds and workers.
    hp = hp_reference and total(s, True, workers, s * n) <= usable
    entries = s * n
    while entries < max(seed_pool, 1) * n and total(s, hp, workers, entries + 1) <= usable:
        entries += 1
    plan.seeds, plan.hp_reference, plan.max_workers, plan.ref_cache_entries = s, hp, workers, max(entries, 1)
    plan.redraw = redraw & set(plan.runnable)
    plan.need_bytes = total(s, hp, workers, entries)
    where = f"a {cap / GB:.2f} GB cap on {device}"
    if s < seeds:
        plan.notes.append(f"memory: {s} seed(s) per workload instead of {seeds} ({where})")
    if hp_reference and not hp:
        plan.notes.append(f"memory: no float64 reference (rel_err not measured) ({where})")
    if workers < parallel:
        plan.notes.append(f"memory: at most {workers} worker(s) in flight instead of {parallel} ({where})")
    for note in plan.notes:
        log.warning("%s: %s", name, note)
    return plan


_LOCK = threading.Lock()


def memory_plan(guard: Any) -> MemoryPlan:
    """The plan of a judge's Guard, made once (dry runs of its reference) and kept on it.

    Reads ``guard.task``, ``guard.workloads``, ``guard.device``, ``guard.cfg`` (seeds, seed_pool, prestart,
    hp_reference, flush_bytes, memory_gb, and ``parallel`` where the session sets it) and ``guard._ref_mod``.
    """
    with _LOCK:
        plan = getattr(guard, "_memory_plan", None)
        if plan is None:
            plan = plan_memory(
                guard.task, list(guard.workloads), guard.device, **plan_settings(guard.cfg), run=guard._ref_mod.run
            )
            guard._memory_plan = plan
        return plan


def plan_settings(cfg: Any) -> dict[str, Any]:
    """The keywords of ``plan_memory`` that a guard's settings give (``GuardSettings``, or a judge's config):
    memory_gb, seeds, seed_pool, parallel where set (else 3), the resident workers, hp_reference, flush_bytes."""
    return {
        "memory_gb": getattr(cfg, "memory_gb", None),
        "seeds": cfg.seeds,
        "seed_pool": cfg.seed_pool,
        "parallel": getattr(cfg, "parallel", 3),
        "prestart": cfg.resident_workers() if hasattr(cfg, "resident_workers") else cfg.prestart,
        "hp_reference": cfg.hp_reference,
        "flush_bytes": cfg.flush_bytes,
        "fresh_inputs_ms": getattr(cfg, "fresh_inputs_ms", 25.0),
    }


def max_parallel(guard: Any, parallel: int) -> int:
    """How many candidates may be in flight on this guard's device (the session's ``executor.parallel``)."""
    return max(1, min(parallel, memory_plan(guard).max_workers))
