"""Integrity of torch and of the harness inside a worker, checked after every candidate call.

Taken before any candidate code exists in the process, compared after each call (``quick``: the
cheap part, after every timed call too) and after each phase and before any output leaves the
worker (``full``):

* no TorchFunctionMode or TorchDispatchMode left on the stacks, no ``sys`` trace / profile hook,
  no ``threading`` hook: a mode or hook that would run during the harness's next torch call is
  how deferred work gets finished where nobody times it;
* the dispatcher entries (``torch._C._dispatch_dump``) of the aten ops the harness itself calls
  between a candidate's call and its outputs leaving (copies, fills, the flush, the input
  rewrites, the comparison of inputs), and any Python kernel registered for an aten op through
  ``torch.library``: a re-registered ``aten::copy_`` could finish an
  unwritten output while the harness copies it out;
* identity of every callable and class in the namespaces the harness uses (``torch``,
  ``torch.Tensor`` and its C base, ``torch.cuda``, ``torch.cuda.Event``, ``torch.nn.functional``,
  ``time``, ``triton``, ``triton.testing``, and what the harness calls besides: ``builtins``, ``os``,
  ``json``, ``random``, ``threading`` and ``pydantic.BaseModel``, which serialises every message), of
  the harness modules' globals and of their functions' ``__code__``.

A change is ``rejected_hack``. The reference and the champion never run in a process that ran
candidate code, so none of this can slow them; what it protects is the candidate's own
measurement and outputs.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from typing import Any

HARNESS_OPS = (
    "aten::copy_", "aten::zero_", "aten::fill_.Scalar", "aten::roll", "aten::clone", "aten::empty.memory_format",
    "aten::empty_strided", "aten::equal", "aten::view", "aten::view.dtype", "aten::_to_copy", "aten::as_strided",
    "aten::set_.source_Storage_storage_offset", "aten::slice.Tensor",
)  # fmt: skip


def _callables(ns: Any) -> dict[str, Any]:
    d = ns.__dict__ if hasattr(ns, "__dict__") else {}
    return {k: v for k, v in list(d.items()) if callable(v) or isinstance(v, types.ModuleType)}


def _codes(mod: types.ModuleType) -> dict[str, Any]:
    out = {}
    for name, v in list(vars(mod).items()):
        if isinstance(v, types.FunctionType) and v.__module__ == mod.__name__:
            out[name] = v.__code__
        elif isinstance(v, type) and v.__module__ == mod.__name__:
            for attr, f in vars(v).items():
                if isinstance(f, types.FunctionType):
                    out[f"{name}.{attr}"] = f.__code__
    return out


def _code_like(v: Any) -> bool:
    """A class attribute through which code runs when it is looked up or called: a function or any callable, a
    property or other descriptor (by its type's slots, no code of its own runs)."""
    return callable(v) or hasattr(type(v), "__get__")


def _torch_rewrap(old: Any, new: Any, roots: tuple[str, ...]) -> bool:
    """``new`` is ``old`` behind wrappers whose code is torch's own (torch._dynamo re-wraps a few torch
    functions, e.g. ``torch.manual_seed``, when torch.compile is first used)."""
    seen = 0
    while new is not old and seen < 8:
        code = getattr(new, "__code__", None)
        if code is None or not code.co_filename.startswith(roots):
            return False
        new = getattr(new, "__wrapped__", None)
        seen += 1
    return new is old


class Integrity:
    def __init__(self, harness_modules: list[types.ModuleType]):
        import time

        import torch

        self.torch = torch
        C = torch._C
        self._dump = C._dispatch_dump
        self._fn_stack = C._len_torch_function_stack
        self._disp_stack = C._len_torch_dispatch_stack
        self._impls = torch.library._impls if isinstance(getattr(torch.library, "_impls", None), set) else None
        names = set(C._dispatch_get_all_op_names())
        self.ops = [op for op in HARNESS_OPS if op in names]
        self.dispatch = {op: self._dump(op) for op in self.ops}
        self.n_impls = len(self._impls) if self._impls is not None else 0
        self.impls0 = set(self._impls) if self._impls is not None else set()
        spaces: dict[str, Any] = {
            "torch": torch, "torch.Tensor": torch.Tensor, "torch._C.TensorBase": C.TensorBase,
            "torch.nn.functional": torch.nn.functional, "time": time, "torch.library": torch.library,
        }  # fmt: skip
        if torch.cuda.is_available():
            spaces.update({"torch.cuda": torch.cuda, "torch.cuda.Event": torch.cuda.Event})
        # What the harness calls between a candidate's call and its reply, beyond torch: its messages (pydantic's
        # BaseModel serialises every one; a patched model_dump_json forged the timing samples), the standard
        # modules it reads seeds, files and JSON through, and the builtins. A class is patched through any alias.
        import builtins
        import json
        import random

        import pydantic

        spaces.update({"builtins": builtins, "os": os, "os.path": os.path, "json": json, "random": random,
                       "random.Random": random.Random, "pydantic.BaseModel": pydantic.BaseModel,
                       "threading": threading, "threading.Thread": threading.Thread})  # fmt: skip
        # Classes whose methods the harness calls on its own objects (its channel's socket, the storages its refill
        # copies through, math in its draws): a second red team patched socket.socket.send (every timing sample at a
        # third) and torch.UntypedStorage.copy_ (only a checked call's refill uses it: it told that call apart).
        # Methods added to them count as patches too (``added``: a class attribute shadowing an inherited one).
        import math
        import select
        import socket

        # torch.Tensor too: the harness reads a plain output's numel(), stride(), untyped_storage(), item() ... which
        # live on the C base, so a method (or property) added to torch.Tensor shadows them, runs where the harness
        # reads an output after the clock, and replaces nothing the check above saw.
        self.added_watch = {"socket.socket": socket.socket, "torch.UntypedStorage": torch.UntypedStorage,
                            "torch.Tensor": torch.Tensor}  # fmt: skip
        self.names0 = {name: set(vars(ns)) for name, ns in self.added_watch.items()}
        spaces.update({**self.added_watch, "math": math, "select": select})
        for name in ("triton", "triton.testing", "triton.language"):
            if name in sys.modules:
                spaces[name] = sys.modules[name]
        self.spaces = spaces
        # the worker's share of the CPU, set before any candidate code ran: a candidate that takes more threads or
        # other cores gets more than the champion had (a red team's 2 threads against a share of 1: 1.3x)
        self.cpu_share = self._cpu_share()
        self.torch_roots = (os.path.dirname(torch.__file__) + os.sep,)
        self.attrs = {name: _callables(ns) for name, ns in spaces.items()}
        self.modules = {m.__name__: m for m in harness_modules}
        self.globals = {m.__name__: _callables(m) for m in harness_modules}  # data globals (caches) may change
        self.codes = {m.__name__: _codes(m) for m in harness_modules}
        self.instances: dict[str, tuple[Any, type, dict[str, Any], frozenset[str]]] = {}
        self.constants: list[tuple[types.ModuleType, str, Any]] = []

    def watch_globals(self, mod: types.ModuleType, names: tuple[str, ...]) -> None:
        """Data globals of a harness module that stay bound to the objects they hold now (the module check watches
        its callables only: data globals such as caches may change). A red team switched the runtime audit off
        through the worker's data global ``_AUDIT``; its state is now the hook's own, and what the harness still
        reads from its modules' data (the audit's event list, the result reader's method names) is watched here."""
        self.constants += [(mod, name, vars(mod)[name]) for name in names]

    def watch(self, label: str, obj: Any, mutable: frozenset[str] | set[str] = frozenset()) -> None:
        """An object of the harness's (its timer, its channel to the judge, the harness itself), from now on: its
        class and every instance attribute but ``mutable`` stay as they are, and no attribute is added. The module
        and class checks above do not see instances: a red team set the timer object's own ``_host`` and the
        channel's own ``send_message`` (instance attributes shadowing the class's methods) and reported every
        sample at an eighth."""
        frozen = {k: v for k, v in vars(obj).items() if k not in mutable}
        self.instances[label] = (obj, type(obj), frozen, frozenset(mutable))

    def quick(self) -> str | None:
        """Mode stacks and trace hooks (cheap: no torch op runs)."""
        if self._fn_stack():
            return "a TorchFunctionMode is left active after the call (work deferred to the harness's torch calls)"
        if self._disp_stack():
            return "a TorchDispatchMode is left active after the call (work deferred to the harness's torch calls)"
        if sys.gettrace() is not None or sys.getprofile() is not None:
            return "a sys trace/profile hook is installed (runs inside the harness)"
        if getattr(threading, "_trace_hook", None) is not None or getattr(threading, "_profile_hook", None) is not None:
            return "a threading trace/profile hook is installed"
        return None

    def _cpu_share(self) -> tuple[int, int]:
        # (not the affinity: the judge itself moves measured workers onto quiet cores, guard.quiet; a candidate's
        # own sched_setaffinity is a banned attribute)
        return self.torch.get_num_threads(), self.torch.get_num_interop_threads()

    def full(self) -> str | None:
        msg = self.quick()
        if msg:
            return msg
        share = self._cpu_share()
        if share != self.cpu_share:
            return f"the worker's CPU share was changed (threads, inter-op threads): {self.cpu_share} -> {share}"
        if self._impls is not None and len(self._impls) != self.n_impls:
            # torch registers kernels of its own namespaces lazily (torch.compile: prims, c10d, ...);
            # a Python kernel for an aten op is a candidate's re-registration.
            new = sorted(x for x in self._impls - self.impls0 if x.startswith("aten/"))
            if new:
                return f"torch.library kernels were registered for aten ops ({', '.join(new[:3])}): dispatcher modified"
            self.n_impls, self.impls0 = len(self._impls), set(self._impls)
        for op, before in self.dispatch.items():
            if self._dump(op) != before:
                return f"the dispatcher entry of {op} was changed (a kernel re-registered for an op the harness uses)"
        for name, before in self.attrs.items():
            ns = self.spaces[name]
            d = ns.__dict__ if hasattr(ns, "__dict__") else {}
            for k, v in before.items():
                now = d.get(k)
                if now is not v and not _torch_rewrap(v, now, self.torch_roots):
                    return f"{name}.{k} was replaced or removed (harness/timer patching)"
            if name in self.added_watch:
                added = sorted(k for k in d if k not in self.names0[name] and _code_like(d[k]))
                if added:
                    return f"{name} got methods of its own: {', '.join(added[:3])} (harness patching)"
        for label, (obj, cls, frozen, mutable) in list(self.instances.items()):
            if type(obj) is not cls:
                return f"the class of the harness's {label} was replaced"
            now = vars(obj)
            for k, v in frozen.items():
                if k not in now or now[k] is not v:
                    return f"the harness's {label}.{k} was replaced or removed (harness patching)"
            added = sorted(set(now) - set(frozen) - mutable)
            if added:
                return f"the harness's {label} got attributes of its own: {', '.join(added[:3])} (harness patching)"
        for mod, name, value in self.constants:
            if vars(mod).get(name) is not value:
                return f"{mod.__name__}.{name} was rebound (harness state)"
        for mname, mod in self.modules.items():
            if sys.modules.get(mname) is not mod:
                return f"sys.modules[{mname!r}] was replaced"
            now = vars(mod)
            for k, v in self.globals[mname].items():
                if now.get(k) is not v:
                    return f"{mname}.{k} was rebound (harness state)"
            for k, code in self.codes[mname].items():
                obj = now.get(k.split(".")[0])
                f = obj if "." not in k else vars(obj).get(k.split(".", 1)[1]) if isinstance(obj, type) else None
                if getattr(f, "__code__", None) is not code:
                    return f"{mname}.{k}.__code__ was replaced (harness code rewritten)"
        return None
