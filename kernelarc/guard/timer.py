"""Timing bursts inside a worker: CUPTI activity records where ``cupti-python`` is importable, CUDA
events always beside them on a GPU, the host clock on the CPU.

With CUPTI (as NVIDIA's SOL-ExecBench harness times, core/bench/timing.py), an iteration's time is
the span from the first to the last kernel / memcpy / memset whose launch the host issued between
two CUPTI timestamps taken around the call: side-stream work the call launched is counted, and a
patched ``Event.elapsed_time`` changes nothing. The CUDA events of the same iterations are returned
too; the judge rejects a candidate whose CUPTI span exceeds its event span beyond noise (kernels
running past the end event: side streams or deferred work) or whose CUDA events disagree with CUPTI.
Without the module, events are the samples (a warning says so).
"""

from __future__ import annotations

import bisect
import logging
import os
import re
import time
import types
from collections.abc import Callable
from typing import Any

from kernelarc.guard.protocol import TimerMethod

log = logging.getLogger(__name__)
_perf_counter = time.perf_counter

try:  # cupti-python (pip: cupti-python), built for CUDA 13; absent on the CPU image
    from cupti import cupti as _cupti
except Exception:  # noqa: BLE001 - any import failure means "no CUPTI"
    _cupti = None

# One CUPTI activity session per worker (enabled at its first timed burst, flushed after each burst) instead of
# one per burst: setting CUPTI up and finalising it costs far more than a burst of short kernels, and a worker
# times some twenty bursts. Read when the harness imports this module, before any candidate code exists.
# KERNELARC_CUPTI_PER_BURST=1: a session per burst (as NVIDIA's harness, which times one run per process).
# (Not a name with SESSION, KEY, TOKEN...: the pool keeps such variables from the workers.)
_ONE_SESSION = os.environ.get("KERNELARC_CUPTI_PER_BURST", "0") != "1"
_FLUSH_FORCED = 1  # CUPTI_ACTIVITY_FLAG_FLUSH_FORCED: deliver every buffer now, full or not

# API records of calls that only ask the driver something (cudaGetDevice, cuStreamGetCaptureInfo,
# cuPointerGetAttribute, cudaEventQuery, occupancy queries, ...) are switched off: they enqueue no device
# work, so no kernel, copy or set record ever correlates with them, and torch makes about a hundred of them
# per call. Measured on the H200 (scripts/gpu_cupti_cost.py): 130 records per call at about 24 us each of
# forced flush, 47 ms of host time per burst of 20 two-kernel calls, most of the guard's timing phase.
# A device record whose launch record is missing (a launching call this pattern would wrongly silence) makes
# the burst fall back to CUDA events (``_cupti``), so a mistake here can cost precision, never hide work.
_QUERY_API = re.compile(r"Get|Query|IsCapturing|Occupancy|Peek")
_WORK_API = re.compile(r"Launch|Memcpy|Memset|Prefetch|Graph|Copy|Signal|Wait|Write|Batch|Record", re.IGNORECASE)
_QUIET = os.environ.get("KERNELARC_CUPTI_ALL_API", "0") != "1"


def _quiet_queries() -> int:
    """Switch off the API records of query calls (``_QUERY_API`` and not ``_WORK_API``); how many."""
    n = 0
    for enum_name, fn_name in (("runtime_api_trace_cbid", "activity_enable_runtime_api"),
                               ("driver_api_trace_cbid", "activity_enable_driver_api")):  # fmt: skip
        cbids, enable = getattr(_cupti, enum_name, None), getattr(_cupti, fn_name, None)
        if cbids is None or enable is None:
            continue
        for member in cbids:
            name = member.name
            if _QUERY_API.search(name) and not _WORK_API.search(name):
                try:
                    enable(int(member), 0)
                    n += 1
                except Exception as e:  # noqa: BLE001 - an unknown cbid on this driver: its records stay on
                    log.debug("CUPTI record switch for %s: %s", name, e)
    return n


class _CuptiSession:
    """CUPTI activity records (kernels, copies, sets and the API calls that launched them) collected from
    ``open`` on; ``take`` forces every buffer out and hands over what came since the last ``take``. Records of
    work outside a burst's timestamps (the harness's own input staging) are never matched to an iteration."""

    KINDS = ("RUNTIME", "DRIVER", "CONCURRENT_KERNEL", "MEMCPY", "MEMSET")

    def __init__(self) -> None:
        self.kinds = [getattr(_cupti.ActivityKind, k) for k in self.KINDS]
        self.device_kinds = set(self.kinds[2:])
        self.api_kinds = set(self.kinds[:2])
        self.launches: list[tuple[int, int]] = []  # (launch start, correlation id)
        self.spans: dict[int, list[tuple[int, int]]] = {}  # correlation id -> device (start, end)
        self.open = False
        self.quieted = 0  # query APIs whose records are off

    def _requested(self):
        return 8 * 1024 * 1024, 0

    def _completed(self, activities) -> None:
        launches, spans = self.launches, self.spans  # the current lists (take() swaps them)
        for a in activities:
            if a.kind in self.device_kinds:
                spans.setdefault(a.correlation_id, []).append((a.start, a.end))
            elif a.kind in self.api_kinds:
                launches.append((a.start, a.correlation_id))

    def start(self) -> None:
        for k in self.kinds:
            _cupti.activity_enable(k)
        if _QUIET:
            self.quieted = _quiet_queries()
        _cupti.activity_register_callbacks(self._requested, self._completed)
        self.open = True

    def take(self, forced: bool = True) -> tuple[list[tuple[int, int]], dict[int, list[tuple[int, int]]]]:
        _cupti.activity_flush_all(_FLUSH_FORCED if forced else 0)
        got = self.launches, self.spans
        self.launches, self.spans = [], {}
        return got

    def close(self) -> None:
        if not self.open:
            return
        self.open = False
        try:
            _cupti.activity_flush_all(0)
            for k in self.kinds:
                _cupti.activity_disable(k)
        finally:
            _cupti.finalize()


class Timer:
    """Times bursts of calls on one device; ``setup(k)`` prepares iteration k's inputs, untimed."""

    def __init__(self, torch: Any, device: Any, flush_bytes: int, head_start_cycles: int, use_cupti: bool = True):
        self.torch = torch
        self.device = device
        self.is_cuda = device.type == "cuda"
        self.head_start = int(head_start_cycles)
        self.notes: list[str] = []
        self._session: _CuptiSession | None = None
        self.cupti_used = False
        if self.is_cuda:
            self.flush = torch.empty(int(flush_bytes), dtype=torch.uint8, device=device)
            self.sleep = getattr(torch.cuda, "_sleep", None)
            self.method = TimerMethod.cupti if (use_cupti and _cupti is not None) else TimerMethod.events
            if self.method is TimerMethod.events:
                self.notes.append("timing: cupti-python not importable, CUDA events only")
        else:
            self.flush = torch.empty(int(min(flush_bytes, 1 << 24)), dtype=torch.uint8)
            self.sleep = None
            self.method = TimerMethod.host

    def burst(
        self, n: int, setup: Callable[[int], list[Any]], fn: Callable[..., Any], keep_at: int | None
    ) -> tuple[list[float], list[float] | None, Any]:
        """(samples ms, CUDA event ms beside CUPTI or None, the kept call's result). ``keep_at``: the index
        of the call whose result is kept (the judge's secret choice, so that a kernel that counts its calls
        cannot tell the checked one); kept as ``(result, values)``, ``values`` a copy taken right after
        that call (outside its timed span) where later calls of the burst could overwrite its outputs
        (a static CUDA-graph output, a persistent buffer), else None."""
        if self.method is TimerMethod.host:
            return self._host(n, setup, fn, keep_at)
        if self.method is TimerMethod.cupti:
            try:
                return self._cupti(n, setup, fn, keep_at)
            except Exception as e:  # noqa: BLE001 - a CUPTI failure falls back to events, said in a note
                self._close_session()
                self.method = TimerMethod.events
                self.notes.append(f"timing: CUPTI failed ({type(e).__name__}: {e}); CUDA events from here on")
        samples, _, last = self._events(n, setup, fn, keep_at, None)
        return samples, None, last

    def _keep(self, out: Any, k: int, n: int) -> tuple[Any, Any]:
        return out, (None if k == n - 1 else _snapshot(self.torch, out))

    def _host(self, n, setup, fn, keep_at):
        samples, last = [], None
        for k in range(n):
            inputs = setup(k)
            self.flush.zero_()
            t = _perf_counter()
            out = fn(*inputs)
            samples.append((_perf_counter() - t) * 1e3)
            if k == keep_at:
                last = self._keep(out, k, n)
            del out
        return samples, None, last

    def _events(self, n, setup, fn, keep_at, stamps: list | None):
        torch = self.torch
        toks, last = [], None
        for k in range(n):
            inputs = setup(k)
            self.flush.zero_()
            if self.sleep is not None and self.head_start > 0:
                # Keep the GPU busy while the host enqueues the call, so that host-side launch cost
                # of short kernels is not timed as device time.
                self.sleep(self.head_start)
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            t0 = _cupti.get_timestamp() if stamps is not None else 0
            s.record()
            out = fn(*inputs)
            e.record()
            if stamps is not None:
                stamps.append((t0, _cupti.get_timestamp()))
            toks.append((s, e))
            if k == keep_at:
                last = self._keep(out, k, n)  # a copy is enqueued after the end event: not timed
            del out
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) for s, e in toks], None, last

    def _close_session(self) -> None:
        session, self._session = self._session, None
        if session is not None:
            try:
                session.close()
            except Exception as e:  # noqa: BLE001 - events from here on anyway
                log.debug("closing the CUPTI session: %s", e)

    def _cupti(self, n, setup, fn, keep_at):
        self.cupti_used = True  # its buffer thread may exist from here on, even after a fall-back to events
        self.torch.cuda.synchronize(self.device)
        if _ONE_SESSION:
            if self._session is None:
                self._session = _CuptiSession()
                self._session.start()
            self._session.take()  # records of everything before this burst: not this burst's
            session = self._session
        else:
            session = _CuptiSession()
            session.start()
        stamps: list[tuple[int, int]] = []
        try:
            # _events ends with a device synchronise: every record is complete, and a flush (a blocking call)
            # delivers them all before it returns
            events, _, last = self._events(n, setup, fn, keep_at, stamps)
            if _ONE_SESSION:
                launches, spans = session.take()
        finally:
            if not _ONE_SESSION:
                session.close()
        if not _ONE_SESSION:
            launches, spans = session.launches, session.spans  # all delivered by finalize
        if _QUIET:
            launched = {c for _, c in launches}
            orphans = [c for c in spans if c not in launched]
            if orphans:
                # device work whose launch went unrecorded: it could not be placed in an iteration
                raise RuntimeError(f"CUPTI: {len(orphans)} device record(s) without their launch record")
        launches.sort()
        starts = [s for s, _ in launches]
        samples = []
        for t0, t1 in stamps:
            lo, hi = bisect.bisect_left(starts, t0), bisect.bisect_right(starts, t1)
            recs = [r for i in range(lo, hi) for r in spans.get(launches[i][1], ())]
            samples.append((max(e for _, e in recs) - min(s for s, _ in recs)) / 1e6 if recs else 0.0)
        if any(c == 0.0 and e > 0.005 for c, e in zip(samples, events, strict=True)):
            # An iteration whose kernels CUPTI did not see (records lost, or CUPTI turned off by the
            # code under test): these samples cannot be trusted; events from here on.
            raise RuntimeError("CUPTI recorded no device activity for an iteration the events timed")
        return samples, events, last

    def single(self, setup: Callable[[int], list[Any]], fn: Callable[..., Any]) -> float:
        """One call timed with events (GPU) or the host clock, synchronised: warm-up and the estimate."""
        if self.is_cuda:
            samples, _, _ = self._events(1, setup, fn, None, None)
        else:
            samples, _, _ = self._host(1, setup, fn, None)
        return samples[0]

    def excess_ms(self, setup: Callable[[int], list[Any]], fn: Callable[..., Any], reps: int = 3) -> float | None:
        """Least device-synchronised wall time minus event time of single calls (GPU only): work
        still running after the call returned (side streams, host threads) shows up here."""
        if not self.is_cuda:
            return None
        torch = self.torch
        ex = []
        for k in range(reps):
            inputs = setup(k)
            torch.cuda.synchronize(self.device)
            s = torch.cuda.Event(enable_timing=True)
            e = torch.cuda.Event(enable_timing=True)
            t = _perf_counter()
            s.record()
            out = fn(*inputs)
            e.record()
            torch.cuda.synchronize()
            wall = (_perf_counter() - t) * 1e3
            ex.append(max(wall - s.elapsed_time(e), 0.0))
            del out
        return min(ex)


# The methods of a result container the harness (or Python, reading it for the harness) could call: a subclass of
# tuple, list or dict that defines any of them in Python runs the candidate's code whenever the harness reads the
# result, after the clock stopped (a red team's list subclass computed its result in ``__iter__``: the unchecked
# timed calls' results were dropped unread, their work never done). Methods implemented in C (a structseq of
# torch.return_types, a collections.namedtuple's field getters) run no candidate code; a namedtuple's own Python
# methods (``_make``, ``_replace``, ``__repr__``) are never called: its items are read as a tuple's.
_CONTAINER_METHODS = types.MappingProxyType({
    tuple: ("__iter__", "__len__", "__getitem__", "__contains__", "__reversed__", "__bool__", "count", "index"),
    list: ("__iter__", "__len__", "__getitem__", "__contains__", "__reversed__", "__bool__", "count", "index", "copy"),
    dict: ("__iter__", "__len__", "__getitem__", "__contains__", "__reversed__", "__bool__", "__missing__", "keys",
           "items", "values", "get", "copy"),
})  # fmt: skip
_ANY_CONTAINER = ("__getattribute__", "__getattr__", "__del__", "__class__")
_C_METHODS = (types.WrapperDescriptorType, types.MethodDescriptorType, types.BuiltinFunctionType,
              types.ClassMethodDescriptorType, types.MemberDescriptorType, types.GetSetDescriptorType)  # fmt: skip


# Read through ``type``'s own descriptors, never an attribute lookup on the class: a metaclass (or a class body,
# for ``__module__``) could answer those with its own code or its own story.
_FLAGS = type.__dict__["__flags__"].__get__
_MRO = type.__dict__["__mro__"].__get__
_TYPE_DICT = type.__dict__["__dict__"].__get__
_TYPE_MODULE = type.__dict__["__module__"].__get__
_TYPE_QUALNAME = type.__dict__["__qualname__"].__get__
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class made by a class statement (C types are not)


def type_name(cls: type) -> str:
    return f"{_TYPE_MODULE(cls)}.{_TYPE_QUALNAME(cls)}"


class NotPlainResult(Exception):
    """A result container whose type runs Python code of its own when read (the worker's verdict: a hack)."""


def plain_items(out: Any) -> list[Any] | dict[Any, Any] | None:
    """The items of a call's result container, read through the base type's own (C) methods: a list for a tuple
    or a list (namedtuples and structseqs included), a dict for a dict; None when ``out`` is not one of them. The
    one reader of result containers, for the worker's outputs (``Harness._normalize``) and the timer's copy of a
    kept result (``_snapshot``). A subclass that overrides in Python a method the read could reach (``__iter__``,
    ``__len__``, ``__getitem__``, ``keys``, a finaliser, ...) or carries attributes of its own raises
    ``NotPlainResult``: its code would run where the harness reads it, outside the timed call."""
    cls = type(out)  # never out.__class__ (a property can lie to isinstance)
    base = next((b for b in (dict, tuple, list) if issubclass(cls, b)), None)
    if base is None:
        return None
    if cls is not base:
        mro = _MRO(cls)
        names = (*_CONTAINER_METHODS[base], *_ANY_CONTAINER)
        over = sorted({n for k in mro[: mro.index(base)] for n, v in _TYPE_DICT(k).items()
                       if n in names and not isinstance(v, _C_METHODS)})  # fmt: skip
        if over:
            raise NotPlainResult(
                f"the result is a {type_name(cls)}, a {base.__name__} whose class defines "
                f"{', '.join(over)} in Python (code that runs when the harness reads the result, after the clock); "
                f"return a plain {base.__name__} (a namedtuple or torch.return_types is fine)"
            )
        try:
            attrs = object.__getattribute__(out, "__dict__")
        except AttributeError:
            attrs = None
        if attrs:
            raise NotPlainResult(
                f"the result is a {type_name(cls)} carrying attributes of its own "
                f"({', '.join(sorted(map(str, attrs))[:3])}); return a plain {base.__name__}"
            )
    if base is dict:
        # never dict(out) or a lookup: they hash and compare the keys, and a key of the candidate's runs its
        # __hash__ / __eq__ there (a thirty-fourth red team did the work in a key's __hash__, run by this copy)
        pairs = list(dict.items(out))
        odd = [k for k, _ in pairs if type(k) is not str]
        if odd:
            raise NotPlainResult(
                f"the result is a dict with a key of type {type_name(type(odd[0]))}: a result dict's keys must "
                "be plain str (the output names); a key's __hash__ / __eq__ is code that runs where the harness "
                "reads the result, after the clock"
            )
        return dict(pairs)
    return list(tuple.__iter__(out)) if base is tuple else list.copy(out)


# Plain values, by exact type (a subclass of any of them can define methods that run when the value is read, hashed,
# compared, formatted or dropped); containers read through their own C methods.
_ATOMS = frozenset({type(None), bool, int, float, complex, str, bytes})
_SEQUENCES = types.MappingProxyType({list: list.__iter__, tuple: tuple.__iter__, set: set.__iter__,
                                     frozenset: frozenset.__iter__})  # fmt: skip
_FUNCTION_KINDS = (types.FunctionType, staticmethod, classmethod, property)


def class_functions(cls: type, mro: bool = True) -> list[types.FunctionType]:
    """The Python functions a class (with ``mro``: and its bases) defines: methods, and those inside staticmethod,
    classmethod and property objects; read from the classes' own dicts by exact type (no code of theirs runs)."""
    out = []
    for k in _MRO(cls) if mro else (cls,):
        for v in _TYPE_DICT(k).values():
            kind = type(v)  # never isinstance: it asks a failing object for its __class__
            if kind in _FUNCTION_KINDS:
                f = v if kind is types.FunctionType else v.fget if kind is property else v.__func__
                if type(f) is types.FunctionType:
                    out.append(f)
    return out


def _torch_class(torch: Any, cls: type) -> bool:
    """Whether ``cls`` is torch's own. A C type named in torch (``torch.Size``, ``torch.dtype``, ...: made in C, its
    name is not the candidate's to choose). A Python class only where every class of its MRO (``object`` and
    torch's C types aside) is reachable by its name from the module it names, that module loaded from torch's
    folder, and every function it defines comes from a file there: ``__module__`` alone is a string a class body
    sets (``__module__ = "torch"``). C bases of any module are C code (``tuple`` under ``torch.Size``)."""
    import sys

    root = os.path.join(os.path.dirname(torch.__file__), "")
    for k in _MRO(cls):
        if not _FLAGS(k) & _HEAP_TYPE and k is not cls:
            continue  # a C base (tuple under torch.Size, torch._C.TensorBase): C code, no class of the candidate's
        mod = _TYPE_MODULE(k)
        if type(mod) is not str or not (mod == "torch" or mod.startswith("torch.")):
            return False
        if not _FLAGS(k) & _HEAP_TYPE:
            continue  # a C type of torch's
        m = sys.modules.get(mod)
        if type(m) is not types.ModuleType or not str(getattr(m, "__file__", None) or "").startswith(root):
            return False
        found: Any = m
        for part in _TYPE_QUALNAME(k).split("."):
            found = getattr(found, part, None)
        if found is not k:
            return False
        if any(not f.__code__.co_filename.startswith(root) for f in class_functions(k, mro=False)):
            return False
    return True


def plain_data(torch: Any, v: Any, depth: int = 0) -> bool:
    """Whether ``v`` is plain data that runs no code of the candidate's when the harness reads, compares or drops it,
    decided without running any: None, bool, int, float, complex, str, bytes, list, tuple, set, frozenset and dict of
    exactly those types (read through their own C methods, at most 4 deep and 1000 long), torch's C types (dtype,
    device, Size, ...), a torch.Tensor or an object of one of torch's classes (``_torch_class``) whose own attributes
    are plain. Anything else, a subclass of any of them included, is not (a dict subclass with an items() of its own,
    hung on an output by a thirty-fourth red team, did the work when the harness looked at it). What the worker
    accepts hung on an output tensor (``Harness._validate``)."""
    cls = type(v)
    if cls in _ATOMS:
        return True
    if depth > 3:
        return False
    if cls in _SEQUENCES:
        items = list(_SEQUENCES[cls](v))
        return len(items) <= 1000 and all(plain_data(torch, x, depth + 1) for x in items)
    if cls is dict:
        pairs = list(dict.items(v))
        return len(pairs) <= 1000 and all(plain_data(torch, x, depth + 1) for kv in pairs for x in kv)
    if not _torch_class(torch, cls):
        return False
    if not _FLAGS(cls) & _HEAP_TYPE:
        return True  # torch.dtype, torch.device, torch.Size, ...: C types with no attributes of their own
    if any("__slots__" in _TYPE_DICT(k) for k in _MRO(cls)):
        return False  # values in slots: not read here
    try:
        attrs = object.__getattribute__(v, "__dict__")  # a torch class's own __dict__ descriptor: torch's code
    except AttributeError:
        return True
    return plain_data(torch, attrs, depth + 1)


def plain_scalar(v: Any) -> bool:
    """Whether ``v`` is a Python scalar output the harness may convert (``buffers.scalar``) without running code of
    the candidate's: a bool, int or float, or a C subclass of int or float (numpy.float64); never a class of the
    candidate's, whose __float__ / __index__ / __bool__ / __format__ would run where the harness reads it."""
    cls = type(v)
    return cls in (bool, int, float) or (not _FLAGS(cls) & _HEAP_TYPE and issubclass(cls, (int, float)))


def _snapshot(torch: Any, out: Any) -> Any:
    """A copy of a call's outputs with their strides (tensors in tuples, lists and dicts, read by ``plain_items``);
    anything else as is. A list or dict is copied as a plain one, a tuple as its own type where ``tuple.__new__``
    makes one without running the type's code (a namedtuple), else as a plain tuple (a structseq). A tensor
    subclass or anything else is left as is (the worker refuses it: ``Harness._validate``)."""
    if type(out) is torch.Tensor:  # through the class: an attribute of the output's own could shadow the method
        return torch.Tensor.clone(out, memory_format=torch.preserve_format)
    items = plain_items(out)
    if items is None:
        return out
    if isinstance(items, dict):
        return {k: _snapshot(torch, v) for k, v in items.items()}
    copied = [_snapshot(torch, x) for x in items]
    if not issubclass(type(out), tuple):
        return copied
    try:
        return tuple.__new__(type(out), copied)
    except TypeError:  # a structseq: its items as a tuple
        return tuple(copied)
