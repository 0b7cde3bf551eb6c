"""The guard on known-good and known-bad kernels: every one gets the right status."""

import contextlib

import pytest
from cpu_guard import rmsnorm_cpu_guard

from kernelarc.guard.static import check_source
from kernelarc.models import Candidate, Status

GOOD = """import torch
def run(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""
TRITON_GOOD = """import torch
import triton
import triton.language as tl

@triton.jit
def _k(x_ptr, w_ptr, y_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + 1e-6)
    tl.store(y_ptr + row * N + offs, (x * inv * w).to(y_ptr.dtype.element_ty), mask=m)

def run(x, weight):
    M, N = x.shape
    y = torch.empty_like(x)
    _k[(M,)](x, weight, y, N, BLOCK=triton.next_power_of_2(N))
    return y
"""
CACHED = """import torch
_CACHE = {}
def run(x, weight):
    key = x.data_ptr()
    if key not in _CACHE:
        xf = x.float()
        _CACHE[key] = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
    return _CACHE[key]
"""
BAD = {
    "wrong": (
        "import torch\ndef run(x, weight):\n    return (x.float() * weight.float()).to(x.dtype)\n",
        Status.incorrect,
    ),
    "drops_weight": (GOOD.replace(" * weight.float()", ""), Status.incorrect),
    "nan": ("import torch\ndef run(x, weight):\n    return torch.full_like(x, float('nan'))\n", Status.incorrect),
    "zeros": ("import torch\ndef run(x, weight):\n    return torch.zeros_like(x)\n", Status.incorrect),
    "unwritten": ("import torch\ndef run(x, weight):\n    return torch.empty_like(x)\n", Status.incorrect),
    "wrong_dtype": (GOOD.replace(".to(x.dtype)", ""), Status.incorrect),
    "crash": ("import torch\ndef run(x, weight):\n    raise RuntimeError('boom')\n", Status.runtime_error),
    "syntax": ("def run(x, weight)\n    return x\n", Status.compile_error),
    "import_error": ("import torch\nimport not_a_module\ndef run(x, weight):\n    return x\n", Status.compile_error),
    "hang": ("import torch\ndef run(x, weight):\n    while True:\n        pass\n", Status.timeout),
    "hang_after_warmup": (
        """import torch
_CALLS = [0]
def run(x, weight):
    _CALLS[0] += 1
    while _CALLS[0] > 1:
        pass
    return torch.zeros_like(x)
""",
        Status.timeout,
    ),
    "alias": ("import torch\ndef run(x, weight):\n    return x\n", Status.rejected_hack),
    "view_of_input": ("import torch\ndef run(x, weight):\n    return x[:, :]\n", Status.rejected_hack),
    "mutates_input": (
        GOOD.replace("    xf = x.float()\n", "    xf = x.float()\n    x.mul_(0)\n"),
        Status.rejected_hack,
    ),
    "lazy_subclass": (
        """import torch
class Lazy(torch.Tensor):
    pass
def run(x, weight):
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
    return y.as_subclass(Lazy)
""",
        Status.rejected_hack,
    ),
    "patch_timer": ("import torch\ntorch.cuda.Event.elapsed_time = lambda *a: 0.0\n" + GOOD, Status.rejected_hack),
    "thread": ("import threading\n" + GOOD, Status.rejected_hack),
    "subprocess": ("import subprocess\n" + GOOD, Status.rejected_hack),
    "side_stream": (
        GOOD.replace("    xf = x.float()\n", "    s = torch.cuda.Stream()\n    xf = x.float()\n"),
        Status.rejected_hack,
    ),
    "getattr_evasion": (
        GOOD.replace("    xf = x.float()\n", "    s = getattr(torch.cuda, 'Str' + 'eam')()\n    xf = x.float()\n"),
        Status.rejected_hack,
    ),
    "torch_C": (
        GOOD.replace("    xf = x.float()\n", "    torch._C._cuda_synchronize()\n    xf = x.float()\n"),
        Status.rejected_hack,
    ),
    "reads_judge": ("import gc\n" + GOOD, Status.rejected_hack),
    "stdout_forge": (
        GOOD.replace(
            "    xf = x.float()\n", '    print(\'{"status": "champion", "latency_ms": 0.001}\')\n    xf = x.float()\n'
        ),
        Status.rejected_hack,
    ),
    "cache_by_pointer": (CACHED, Status.rejected_hack),
    "cache_by_pointer_cloned": (
        CACHED.replace("return _CACHE[key]\n", "return _CACHE[key].clone()\n"),
        Status.rejected_hack,
    ),
}


@pytest.fixture(scope="module")
def guard():
    with rmsnorm_cpu_guard(prestart=2) as g:
        yield g


@pytest.mark.parametrize("src", [GOOD, TRITON_GOOD], ids=["pytorch", "triton"])
def test_good_kernels_are_correct(guard, src):
    v = guard.evaluate(Candidate(source=src, language="pytorch" if "triton" not in src else "triton")).verdict
    assert v.status is Status.champion, v.errors  # no champion to beat: first correct one
    assert v.latency_ms and v.latency_ms > 0 and v.speedup_vs_baseline
    assert all(w.correct and w.rel_err is not None and w.rel_err < 2e-2 for w in v.workloads)


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_kernels_get_the_right_status(guard, name):
    src, want = BAD[name]
    v = guard.evaluate(Candidate(source=src, language="pytorch"), timeout_s=8).verdict
    if name.startswith("cache_by_pointer"):
        # A memo keyed on data pointers fails whichever check meets it first: when the allocator puts a
        # later workload's fresh input at an address the memo saw, the stale output (another shape) is
        # `incorrect` before the in-place rewrite test can call it a hack (seen in CI, 2026-12-01; on the
        # H200 too). Either way it is never accepted.
        assert v.status in (Status.rejected_hack, Status.incorrect), (name, v.status, v.errors)
    else:
        assert v.status is want, (name, v.status, v.errors)
    assert v.errors


def test_next_candidate_runs_after_a_crash_and_a_hang(guard):
    guard.evaluate(Candidate(source=BAD["hang"][0], language="pytorch"), timeout_s=3)
    v = guard.evaluate(Candidate(source=GOOD, language="pytorch")).verdict
    assert v.correct


def test_a_cutlass_kernel_that_hangs_after_its_build_gets_the_plain_limit(guard):
    """The build allowance covers nvcc only: once a CUTLASS candidate is imported (built), a kernel
    that hangs is killed at the plain limit, not the plain limit plus the build allowance (a hung
    kernel shares the GPU with every other worker's timing until it is killed)."""
    import dataclasses
    import time

    cfg, guard.cfg = guard.cfg, dataclasses.replace(guard.cfg, build_timeout_s=120.0)
    try:
        t0 = time.monotonic()
        v = guard.evaluate(Candidate(source=BAD["hang"][0], language="cutlass"), timeout_s=3).verdict
        took = time.monotonic() - t0
    finally:
        guard.cfg = cfg
    assert v.status is Status.timeout, v.errors
    assert "after its build" in " ".join(v.errors)
    assert took < 60, took
    # it hung while holding the GPU (a CUTLASS candidate warms up under the lock, so a hang never
    # shares the device with another candidate's timing); a Triton/PyTorch one warms up outside it
    assert "gpu_wait" in v.phases, v.phases
    v = guard.evaluate(Candidate(source=BAD["hang"][0], language="pytorch"), timeout_s=3).verdict
    assert v.status is Status.timeout and "gpu_wait" not in v.phases, v.phases


def test_static_checks_allow_ordinary_kernels():
    assert check_source(TRITON_GOOD).ok
    assert check_source(
        "import os\nimport torch\nINTERP = os.environ.get('TRITON_INTERPRET') == '1'\ndef run(x):\n    return x + 1\n"
    ).ok


def test_names_spelt_as_strings_for_a_resolver_are_rejected_and_ordinary_strings_are_not():
    """pkgutil.resolve_name("sys:_getframe") turned a string into the frame reader past every rule on names (the
    thirtieth session's red team): the resolvers are banned modules, and a dotted or module:attr string that names a
    banned module or a forbidden attribute is flagged wherever it appears."""
    body = "import torch\ndef run(x):\n    return x + 1\n"
    for bad in (
        "sys:_getframe",
        "inspect.currentframe",
        "os:_exit",
        "unittest.mock",
        "builtins.getattr",
        "x.f_back",
        "kernelarc.guard.timer:_perf_counter.__code__",
        "torch.utils.cpp_extension.load_inline",
    ):
        rep = check_source(f"N = {bad!r}\n" + body)
        assert not rep.ok and any(bad in v for v in rep.violations), (bad, rep)
    for mod in ("pkgutil", "pydoc", "unittest.mock", "logging.config", "torch.utils.cpp_extension"):
        assert not check_source(f"import {mod}\n" + body).ok, mod
    for fine in (
        "torch.float16",
        "x.shape",
        "cuda:0",
        "a.b.c",
        "triton.language",
        "os.environ",
        "__main__",
        "timing.times",
        "torch.cuda.synchronize",
    ):
        assert check_source(f"N = {fine!r}\n" + body).ok, fine
    # a second red team: resolvers and hidden evals inside allowed modules, and a parameter named like a builtin
    for bad in (
        "_r = torch._utils._import_dotted_name\n",
        "import string\n_g = string.Formatter().get_field\n",
        "import typing\n_h = typing.get_type_hints\n",
        "def _pick(getattr=getattr):\n    return getattr\n",
    ):
        assert not check_source(bad + body).ok, bad
    # ... and no rule on ordinary attributes named like a banned module's last part
    for fine in ("c = torch._inductor.config.max_autotune\n", "class C:\n    config = 1\nc = C().config\n"):
        assert check_source(fine + body).ok, fine


def test_every_family_renders_sources_the_static_checks_accept():
    import random

    from kernelarc.families import all_families

    rng = random.Random(0)
    for fam in all_families().values():
        points = [dict(fam.start)]
        for _ in range(10):
            p = {k.name: rng.choice(k.values) for k in fam.knobs}
            if fam.valid(p):
                points.append(p)
        for p in points:
            rep = check_source(fam.render(p))
            assert rep.ok, (fam.name, p, rep)


def test_candidates_may_not_import_the_harness():
    from kernelarc.guard.static import check_source

    for src in ("from kernelarc.guard import worker", "import kernelarc.session", "from kernelarc import board"):
        report = check_source(src + "\ndef run(x):\n    return x\n")
        assert not report.ok and "harness" in " ".join(report.violations), src
    assert check_source("from kernelarc import cutlass as _c\ndef run(x):\n    return x\n").ok


def test_killing_a_worker_takes_what_it_started_with_it(guard):
    """A timed-out CUTLASS candidate leaves no nvcc running: the worker's session, group and (as root)
    uid are killed with it. A candidate (past the static checks) starts a `sleep` standing in for the
    build and hangs in its import."""
    import os
    import tempfile
    import time
    from pathlib import Path

    d = Path(tempfile.mkdtemp(prefix="kernelarc-test-", dir="/tmp"))
    d.chmod(0o777)
    pidfile = d / "build.pid"
    src = (
        "import subprocess, time\n"
        "p = subprocess.Popen(['sleep', '120'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(120)\n" + GOOD
    )
    v = guard.evaluate(Candidate(source=src, language="pytorch"), trusted=True, timeout_s=3).verdict
    assert v.status is Status.timeout, v.errors
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break
        except OSError:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        raise AssertionError("the worker's child survived its kill")


def test_a_busy_worker_dies_with_a_killed_search():
    """A search killed outright (SIGKILL: no cleanup runs) leaves nothing behind: a worker busy in
    a build watches its parent and kills its own process group (itself and its nvcc, here a
    `sleep`) once the parent is gone."""
    import os
    import signal
    import subprocess
    import sys
    import time

    worker = (
        "import os, subprocess, time\n"
        "from kernelarc.guard.worker import _die_with_parent\n"
        "os.setpgid(0, 0)\n"
        "_die_with_parent(0.2)\n"
        "build = subprocess.Popen(['sleep', '120'])\n"
        "print(os.getpid(), build.pid, flush=True)\n"
        "build.wait()\n"
    )
    search = (
        "import subprocess, sys, time\n"
        f"w = subprocess.Popen([sys.executable, '-c', {worker!r}], stdout=subprocess.PIPE, text=True)\n"
        "print(w.stdout.readline().strip(), flush=True)\n"
        "time.sleep(120)\n"
    )

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                return not fh.read().split(") ")[1].startswith("Z")
        except OSError:
            return False

    parent = subprocess.Popen([sys.executable, "-c", search], stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(alive(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 15
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(p) for p in pids), "the worker or its build outlived the killed search"
    finally:
        for p in pids:
            with contextlib.suppress(OSError):
                os.kill(p, signal.SIGKILL)
        if parent.poll() is None:
            parent.kill()


def _steps_per_second() -> float:
    """How fast this machine runs an empty Python loop: the busy loops below stand for compile and run times."""
    import time

    n = 2_000_000
    t = time.perf_counter()
    for _ in range(n):
        pass
    return n / max(time.perf_counter() - t, 1e-6)


# A candidate whose first call takes seconds (Inductor compiling at a torch.compile'd function's first call: a busy
# loop of about 8 s here), then runs as GOOD does; "NAME" names torch.compile in the code or only in a comment.
COMPILES_AT_FIRST_CALL = """import torch
NAME
_FIRST = [True]
def run(x, weight):
    if _FIRST[0]:
        _FIRST[0] = False
        for _ in range(STEPS):
            pass
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""


def test_a_candidate_that_compiles_at_its_first_call_gets_the_compile_allowance_for_its_warm_up(guard):
    """On the H200 with eight suite sessions compiling at once, 16 of 141 composed candidates that compile the rest of
    their graph with Inductor had no result within guard.timeout_s=40: their compilation, at the first call, counted
    as run time. A candidate whose code names torch.compile gets guard.compile_timeout_s for its warm-up."""
    import dataclasses

    from kernelarc.guard.static import calls_torch_compile

    src = COMPILES_AT_FIRST_CALL.replace("STEPS", str(int(8 * _steps_per_second())))
    compiles = src.replace("NAME", "_fn = torch.compile(lambda t: t)")
    mentions = src.replace("NAME", "# torch.compile(lambda t: t)")
    assert calls_torch_compile(compiles) and not calls_torch_compile(mentions)
    cfg, guard.cfg = guard.cfg, dataclasses.replace(guard.cfg, compile_timeout_s=120.0)
    try:
        v = guard.evaluate(Candidate(source=compiles, language="pytorch"), timeout_s=1.5).verdict
        assert v.correct, (v.status, v.errors)
        v = guard.evaluate(Candidate(source=mentions, language="pytorch"), timeout_s=1.5).verdict
        assert v.status is Status.timeout and "no result within 2 s" in " ".join(v.errors), v.errors
    finally:
        guard.cfg = cfg


def test_once_warmed_up_a_compiling_candidate_gets_the_plain_limit(guard):
    """The allowance is for the warm-up only, and what the warm-up leaves of it is taken back: a candidate that names
    torch.compile and then runs too slowly for the plain limit in its checks is killed at that limit, not at the
    limit plus the allowance."""
    import dataclasses
    import time

    slow = """import torch
_fn = torch.compile
def run(x, weight):
    for _ in range(STEPS):  # about 0.5 s a call: the checks alone take several times the plain 1 s
        pass
    return (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
""".replace("STEPS", str(int(0.5 * _steps_per_second())))
    cfg, guard.cfg = guard.cfg, dataclasses.replace(guard.cfg, compile_timeout_s=60.0)
    try:
        t0 = time.monotonic()
        v = guard.evaluate(Candidate(source=slow, language="pytorch"), timeout_s=1.0).verdict
        took = time.monotonic() - t0
    finally:
        guard.cfg = cfg
    assert v.status is Status.timeout, (v.status, v.errors)
    assert took < 30, took


def _all_rejected(sources: tuple[str, ...], body: str) -> None:
    for bad in sources:
        assert not check_source(bad + body).ok, bad


def test_only_modules_on_the_allow_list_may_be_imported():
    """A module nobody banned was a hole until a red team found it (pkgutil, pydoc, datetime, ...): anything outside
    the allow-list is refused, with the list in the message. Every SOL-ExecBench reference in ../shared (whose code
    composed candidates carry) and the ordinary computational imports pass."""
    import json

    from shared_dirs import shared_path

    from kernelarc.guard.static import ALLOWED_IMPORT_ROOTS

    body = "\ndef run(x):\n    return x\n"
    bads = (
        "import mmap",
        "import atexit",
        "import faulthandler",
        "import ast",
        "import dis",
        "import urllib.request",
        "from http import client",
        "import tracemalloc",
        "from sysconfig import get_paths",
        "import select",
    )
    for bad in bads:
        rep = check_source(bad + body)  # refused (a compile error), not a hack: nothing reached yet
        assert not rep.ok and not rep.violations, rep
        assert any("not among the modules a candidate may import" in v for v in rep.refused), rep
    assert check_source("from . import sibling" + body).refused
    for fine in ("import torch.nn.functional as F", "from typing import Optional", "import triton.language as tl",
                 "from functools import lru_cache", "from collections import OrderedDict",
                 "from __future__ import annotations", "import math, enum"):  # fmt: skip
        assert check_source(fine + body).ok, fine
    # of os, the environment: os.write on the worker's socket would forge the harness's replies
    os_bad = (
        "import os\nos.write(5, b'x')",
        "import os as _o\n_f = _o\n_f.open('/proc/self/mem', 2)",
        "from os import write",
        "import os\n_w = getattr(os, 'write')",
        "import numpy",
        "import cutlass",
    )
    _all_rejected(os_bad, body)
    assert check_source("import os\nI = os.environ.get('X') == '1'\nP = os.path.join('a', 'b')" + body).ok
    assert check_source("import sys" + body).violations == ("line 1: imports sys (can reach the harness through "
                                                            "sys.modules/frames)",)  # fmt: skip
    tree = shared_path("sol-execbench")
    refs = sorted(tree.glob("*/*/definition.json"))
    for d in refs:
        rep = check_source(json.loads(d.read_text())["reference"])
        assert not [v for v in rep.violations if "imports" in v], (d.parent.name, rep.violations)
    assert len(refs) == 45 or not tree.is_dir()
    assert {"torch", "triton", "math", "os"} <= ALLOWED_IMPORT_ROOTS


def test_a_chain_of_attributes_that_reaches_a_module_a_candidate_may_not_import_is_rejected():
    """A third red team (thirty-first session): libraries' own imports are attributes of them, so ``enum.bltns.exec``
    reached exec (crowned 390x on L1/008 after forging the timer), ``torch.os.open`` and ``random._os.write`` the os
    functions outside the allow-list, ``typing.types`` and ``torch.serialization.io`` banned modules. Every chain of
    attributes rooted at an import (or a name bound to one, or a getattr with a constant) is walked on the real
    modules; ordinary chains through torch, triton, os.environ and os.path pass."""
    body = "\ndef run(x):\n    return x\n"
    chains = ("import enum\nenum.bltns.exec('1')", "import torch\ntorch.os.open('/proc/self/mem', 2)",
              "import random\nrandom._os.write(5, b'')", "import contextlib\ncontextlib.os.lseek(1, 2, 3)",
              "import collections\nm = collections._sys.modules", "import typing\nF = typing.types.FunctionType",
              "import torch\ntorch.serialization.io.open('x')", "from enum import bltns",
              "import enum\n_e = enum.bltns\n_e.exec('1')", "import enum\n_b = getattr(enum, 'bltns')")  # fmt: skip
    for bad in chains:
        rep = check_source(bad + body)
        assert not rep.ok and any("which reaches" in v for v in rep.violations), (bad, rep)
    # a fourth red team: a module wrapped in a value, an attribute imported by name, annotations and field names
    # that libraries evaluate, FX's generated code
    fourth = (
        "import enum\nb = [enum][0].bltns",
        "import os\nw = (lambda: os)().write",
        "from torch._utils import _import_dotted_name",
        "import functools\nd = functools.singledispatch",
        "import dataclasses",
        "class C:\n    __annotations__ = {'a': int}",
        "import torch\ng = torch.fx.Graph()",
        "import random\no = random.Random()._os",
        "import warnings\nm = warnings.catch_warnings()._module",
    )
    _all_rejected(fourth, body)
    fine = ("import torch\nimport torch.nn.functional as F\ny = F.softmax\nz = torch.nn.functional.gelu",
            "import os\nI = os.environ.get('X')\nP = os.path.join('a', 'b')",
            "import triton\nimport triton.language as tl\nc = tl.constexpr\nd = triton.cdiv",
            "import torch\ns = torch.cuda.current_stream\nt = torch._inductor.config.max_autotune",
            "import torch\na = torch.ops.aten.mm.default", "from torch.nn.attention import SDPBackend, sdpa_kernel",
            "import re\nr = re.compile('a')")  # fmt: skip
    for ok in fine:
        assert check_source(ok + body).ok, (ok, check_source(ok + body))


def test_the_thirty_third_red_teams_routes_are_refused_by_the_static_checks():
    """torch.utils.benchmark.Timer runs its setup text (timeit's exec), however reached, also where the judge never
    imported the module (its name is enough); a class's special methods that the harness would run when it reads a
    result (a lazy __iter__) are refused; so are torch's private modules (PyCodeCache.load imports text as a module)
    but the compilers' packages and configs, torch.load / save, from_file and weights_only=False. A flag named like
    the module (cudnn.benchmark), torch's private functions (_scaled_mm) and ordinary classes pass."""
    body = "\ndef run(x):\n    return x\n"
    _all_rejected(
        (
            "import torch.utils.benchmark as tb",
            "from torch.utils import benchmark",
            "from torch.utils.benchmark import Timer",
            "import torch\nT = torch.utils.benchmark.Timer",
            "import torch\nT = getattr(torch.utils, 'benchmark')",
            "class L(list):\n    def __iter__(self):\n        return iter([])",
            "class T(tuple):\n    __len__ = lambda self: 1",
            "class D(dict):\n    def __missing__(self, k):\n        return 0",
            "class F:\n    def __del__(self):\n        pass",
            "class G:\n    def __init_subclass__(cls):\n        pass",
            # H2 / H4: torch's private modules, torch.load / save, files mapped into storages, pickles
            "from torch._inductor.codecache import PyCodeCache",
            "from torch._inductor import codecache",
            "import torch\nP = torch._inductor.codecache.PyCodeCache",
            "import torch\nu = torch._dynamo.utils",
            "import torch._inductor.codecache",
            "import torch\nl = torch.load",
            "from torch import save",
            "import torch.serialization",
            "import torch\ns = torch.UntypedStorage.from_file('x', True, 8)",
            "import torch\ns = torch.from_file('x', True, 8)",
            "import torch\nk = dict(weights_only=False)",
            "import torch.hub",
        ),
        body,
    )
    for ok in (
        "import torch\nb = torch.backends.cudnn.benchmark",
        "import torch\nt = torch._inductor.config.max_autotune\nd = torch._dynamo.config.cache_size_limit",
        "import torch._inductor.config as c\nfrom torch._inductor import config",
        "import torch\nf = torch._scaled_mm\ng = torch._grouped_mm\nm = torch._dynamo.mark_dynamic",
        "from torch import _scaled_mm",
        "from torch.utils._pytree import tree_map",
        "class C:\n    __slots__ = ('a',)\n    def __init__(self):\n        self.a = 1\n    def __call__(self, x):\n"
        "        return x\n    def __repr__(self):\n        return 'C'",
        "import collections\nP = collections.namedtuple('P', 'a b')",
    ):
        assert check_source(ok + body).ok, (ok, check_source(ok + body))


def test_compilers_that_build_what_they_are_given_are_refused_by_the_static_checks():
    """Code under a compiler's frames passes the runtime audit (Inductor and Triton compile, write and load files as
    their work), so the compilers' entry points that take text or C from the caller are refused by the static checks:
    Triton's builders (triton.runtime.build, the backends' drivers, triton.compiler, triton._C), loaders of native
    code from files, and a private torch module reached by a chain past an allowed package the judge never imported
    (torch._inductor.codecache after ``import torch._inductor``: the walk used to stop at the first module it could
    not see). Triton's kernel API, its device queries and torch.compile beside Inductor's config pass."""
    body = "\ndef run(x):\n    return x\n"
    _all_rejected(
        (
            "import triton.runtime.build as b",
            "import triton\nf = triton.runtime.build.compile_module_from_src",
            "from triton.backends.nvidia.driver import compile_module_from_src",
            "import triton\nL = triton.runtime.driver.active.launcher_cls",
            "from triton._C import libtriton",
            "import triton.compiler",
            "from triton.runtime.cache import get_cache_manager",
            "import torch\nimport torch._inductor\nP = torch._inductor.codecache.PyCodeCache",
            "import torch._inductor as ind\nP = ind.codecache.PyCodeCache",
            "import torch\nimport torch._inductor\nf = torch._inductor.aoti_load_package",
            "import torch\nf = torch.ops.load_library",
        ),
        body,
    )
    for ok in (
        "import torch\nimport torch._inductor.config as ic\nf = torch.compile(lambda y: y * 2)",
        "import triton\nn = triton.runtime.driver.active.utils.get_device_properties",
        "import triton\nimport triton.language as tl\nfrom triton.tools.tensor_descriptor import TensorDescriptor",
        "import triton\nc = triton.cdiv(3, 2)\nj = triton.jit",
        "import torch\nimport torch._inductor\nm = torch._inductor.config.max_autotune",
    ):
        assert check_source(ok + body).ok, (ok, check_source(ok + body))


def test_compiler_settings_and_the_environment_are_literal():
    """A seventh red team passed a string Inductor option that went into g++'s command line ("off -wrapper
    '/bin/sh,-c,...'", under Inductor's frames), and set NVCC_PREPEND_FLAGS through
    ``MutableMapping.update(os.environ, ...)``. torch.compile takes a mode and a backend by name and options as a
    literal dict of flags and numbers, under any name; the environment is read, never handed to a function; the
    compilers' configuration is not patched."""
    body = "\ndef run(x):\n    return x\n"
    _all_rejected(
        (
            "import torch\nf = torch.compile(lambda t: t, options={'cpp.enable_floating_point_contract_flag': 'x'})",
            "import torch\ntc = torch.compile\nf = tc(lambda t: t, options={'a': 'b'})",
            "import torch\nf = torch.compile(lambda t: t, backend=lambda g, i: g)",
            "import torch\nf = torch.compile(lambda t: t, mode='custom')",
            "import torch\nf = torch.compile(lambda t: t, **{'mode': 'default'})",
            "import torch\nO = {'max_autotune': True}\nf = torch.compile(lambda t: t, options=O)",
            "import collections.abc\nimport os\ncollections.abc.MutableMapping.update(os.environ, {'A': 'b'})",
            "import os\nd = dict.update(os.environ, A='b')",
            "import torch._inductor.config as c\nc.patch({'max_autotune': True})",
        ),
        body,
    )
    for ok in (
        "import torch\nf = torch.compile(lambda t: t, mode='max-autotune-no-cudagraphs', dynamic=False)",
        "import torch\nf = torch.compile(lambda t: t, options={'max_autotune': False, 'epilogue_fusion': True})",
        "import torch\nimport torch.nn.functional as F\ny = F.interpolate(torch.ones(1, 1, 4), size=8, mode='linear')",
        "import os\nv = os.environ.get('X', 'y')\nw = 'A' in os.environ\nz = os.environ['HOME'] if w else v",
        "import re\nr = re.compile('a', re.I)",
    ):
        assert check_source(ok + body).ok, (ok, check_source(ok + body))
