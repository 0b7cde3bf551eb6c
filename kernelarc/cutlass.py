"""Trusted build helper for CUTLASS candidates (language ``cutlass``).

A CUTLASS candidate is a Python file like any other (``run(*inputs)``); it carries its C++
source as a string and calls :func:`load` at import time. This module, not the candidate,
runs nvcc (candidates may not start processes or use ctypes: see guard/static.py) against
the CUTLASS headers bundled in the ``nvidia-cutlass`` wheel, caches the shared library by
the hash of its source and flags, and hands back a small handle whose calls take torch
tensors and launch on the current CUDA stream.

The C++ side exports a fixed C ABI (``templates/cutlass/README.md``)::

    extern "C" int    kernelarc_run(const void* const* in, void* const* out, const long long* dims,
                                    void* workspace, void* stream);
    extern "C" size_t kernelarc_workspace(const long long* dims);

``dims`` are the problem sizes the candidate passes (e.g. M, N, K); the return value is 0 on
success or a CUTLASS status code, which becomes a RuntimeError.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

ARCH = "sm_90a"  # Hopper: wgmma, TMA and clusters need the arch-specific target
NVCC_FLAGS = (
    "-O3",
    "-std=c++17",
    "--expt-relaxed-constexpr",
    "-DNDEBUG",
    "-shared",
    "-Xcompiler=-fPIC",
    "-Xcompiler=-fvisibility=hidden",
    "-Xptxas=-v",  # registers, spills and shared memory per kernel go to build.log
)
BUILD_TIMEOUT_S = 900.0
_LOCK = threading.Lock()
_LOADED: dict[str, Any] = {}


class CutlassUnavailable(RuntimeError):
    """nvcc or the CUTLASS headers are missing on this machine."""


class CutlassSourceRefused(RuntimeError):
    """The C++ of a CUTLASS candidate reaches past its kernel (``check_source``): the guard's verdict is a hack."""


# What a candidate's C++ may include: CUTLASS and CuTe (and the FMHA example's headers it bundles), the CUDA
# runtime's headers for the types and launches a kernel needs, and the standard library's computational headers.
ALLOWED_INCLUDES = re.compile(
    r"(cutlass|cute|88_hopper_fmha)/[\w./]+"
    r"|cuda_runtime(_api)?\.h|cuda\.h|cuda_(bf16|fp16|fp8)\.h(pp)?|cuda/(barrier|pipeline|ptx|std/\w+)"
    r"|c(stdint|stddef|stdio|math|limits|float|assert)|algorithm|array|limits|numeric|tuple|type_traits|utility"
    r"|initializer_list|functional|cstring"
)
# Host-side reach past the kernel: the loaded library runs inside the guard's worker, beside the timer. Loaders and
# the Python C API (they reach the interpreter and the harness's objects), processes and threads (work after the
# call), files and raw memory maps, callbacks the CUDA runtime runs on the host later, system calls (also as inline
# assembly), code run at load (constructors), and token pasting (how a banned name is spelt in pieces).
_CPP_FORBIDDEN = re.compile(
    r"\b(dlopen|dlsym|dlvsym|dlmopen|dladdr|dlinfo|Py[A-Z]\w*|_Py\w*|system|popen|fork|vfork|exec[lv]p?e?"
    r"|posix_spawn\w*|pthread_\w+|std::thread|std::jthread|std::async|syscall|mmap|munmap|mprotect|fopen|fdopen"
    r"|freopen|tmpfile|tmpnam|open|openat|creat|unlink|remove|rename|getenv|setenv|putenv|environ|signal|sigaction"
    r"|raise|kill|ptrace|process_vm_\w+|clock_gettime|gettimeofday|cudaLaunchHostFunc|cudaStreamAddCallback"
    r"|cuLaunchHostFunc|cuStreamAddCallback|cudaHostRegister|atexit|at_quick_exit|__builtin_frame_address"
    r"|__builtin_return_address)\b"
    # code run at load, whatever the spelling (__constructor__, [[gnu::constructor]], a section of pointers)
    r"|constructor|destructor|init_priority|init_array|fini_array|\.ctors|\.dtors|\bsection\b"
    r"|##|/proc/"
)
# inline assembly is PTX in device code (CUTLASS's own barriers): not a label naming a host symbol (``int f()
# __asm__("system")``), nor host directives (a file's bytes pulled in, a section of its own), nor a system call
_ASM_LABEL = re.compile(r"\)\s*(?:__asm__|__asm|asm)\s*\(|\b(?:__asm__|__asm|asm)\s*\(\s*\"[\w.$]*\"\s*\)\s*[;=,]")
_ASM_HOST = re.compile(r"\.(?:incbin|section|pushsection|previous|init_array|byte|ascii|quad)\b|\bsyscall\b"
                       r"|\bsysenter\b|\bint\s*\$?0x80\b")  # fmt: skip
# the preprocessor's other spellings: digraphs and trigraphs of #, [ ] { }, and lines spliced by a backslash
_SPELLINGS = (("??=", "#"), ("%:", "#"), ("<:", "["), (":>", "]"), ("<%", "{"), ("%>", "}"), ("??/", "\\"))
# a compiler's environment may carry flags and paths past the source check (NVCC_PREPEND_FLAGS: a red team's macro)
_BUILD_ENV_DROP = ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS", "CPATH", "C_INCLUDE_PATH", "CPLUS_INCLUDE_PATH",
                   "LIBRARY_PATH", "LD_PRELOAD", "GCC_EXEC_PREFIX", "COMPILER_PATH", "NVCC_CCBIN")  # fmt: skip
# host symbols a built library may not import (the Python C API, processes): what the source check missed
_SYMBOLS_FORBIDDEN = re.compile(r"_?Py\w+|system|popen|fork|vfork|exec\w*|posix_spawn\w*|ptrace|process_vm_\w+")


def check_source(source: str) -> list[str]:
    """Why a CUTLASS candidate's C++ may not be built (empty: it may): an ``#include`` outside ``ALLOWED_INCLUDES``
    (or one named by a macro), a name of ``_CPP_FORBIDDEN`` anywhere in its text (comments and strings included: a
    string can open what looks like a comment and hide the rest of a line), inline assembly that names a host symbol
    or uses host directives. The text is read as the preprocessor would: digraphs and trigraphs spelt out, lines
    spliced at a backslash. A rule set: a seventh red team got past a first one nine ways; ``build`` also checks
    the library's imported symbols."""
    text = source
    for a, b in _SPELLINGS:
        text = text.replace(a, b)
    text = re.sub(r"\\\s*\n", "", text)
    found = []
    for m in re.finditer(r"^\s*#\s*(include|include_next|import)\b\s*(.*)$", text, re.M):
        arg = m.group(2).strip()
        name = re.fullmatch(r'<([^>]+)>|"([^"]+)"', arg.split("//")[0].strip())
        if m.group(1) != "include" or name is None or not ALLOWED_INCLUDES.fullmatch((name[1] or name[2]).strip()):
            found.append(f"#{m.group(1)} {arg} (a candidate's C++ includes CUTLASS, CuTe, CUDA's and computational "
                         "headers, by name)")  # fmt: skip
    found += [f"uses {m.group(0)!r} in assembly (a host symbol, directive or system call)"
              for rx in (_ASM_LABEL, _ASM_HOST) for m in rx.finditer(text)]  # fmt: skip
    for m in _CPP_FORBIDDEN.finditer(text):
        found.append(f"uses {m.group(0)} (reaches past the kernel: the library runs inside the guard's worker)")
    return found


def _imported_symbols(lib: str) -> list[str] | None:
    """The undefined dynamic symbols of a built library (None: ``nm`` is not on this machine)."""
    nm = shutil.which("nm")
    if nm is None:
        return None
    out = subprocess.run([nm, "-D", "--undefined-only", lib], capture_output=True, text=True, timeout=60, check=False)
    return [ln.split()[-1].split("@")[0] for ln in out.stdout.splitlines() if ln.strip()]


def nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for cand in ("/usr/local/cuda/bin/nvcc",):
        if os.path.exists(cand):
            return cand
    return None


def include_dirs() -> list[str]:
    """CUTLASS and CuTe headers from the ``nvidia-cutlass`` wheel (found without importing it)."""
    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        raise CutlassUnavailable("CUTLASS headers not found: pip install nvidia-cutlass==4.2.0.0 --no-deps")
    root = Path(next(iter(spec.submodule_search_locations))) / "source"
    # examples/: the Hopper FMHA kernel (88_hopper_fmha) the attention template builds on
    dirs = [root / "include", root / "tools" / "util" / "include", root / "examples"]
    if not (dirs[0] / "cutlass" / "cutlass.h").is_file():
        raise CutlassUnavailable(f"CUTLASS headers missing under {root}")
    return [str(d) for d in dirs]


def available() -> bool:
    """nvcc and the headers are present (a GPU is not needed to build, only to run)."""
    try:
        include_dirs()
    except CutlassUnavailable:
        return False
    return nvcc() is not None


def cache_dir() -> Path:
    base = os.environ.get("KERNELARC_CUTLASS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "kernelarc", "cutlass"
    )
    return Path(base)


LIB_MODE = 0o644  # what a compiler's own output gets under the usual umask


def build(source: str, arch: str = ARCH) -> Path:
    """Compile ``source`` to a shared library (cached by content); return its path.

    Concurrent builds of the same source (several guard workers) are safe: each compiles to
    a private temporary name and renames it into place atomically.
    """
    if refused := check_source(source):
        raise CutlassSourceRefused("CUTLASS source refused: " + "; ".join(dict.fromkeys(refused)))
    exe = nvcc()
    if exe is None:
        raise CutlassUnavailable("nvcc not found: CUTLASS candidates need the CUDA toolkit")
    incs = include_dirs()
    # SASS for this arch only: "-arch=sm_90a" also runs cicc for generic compute_90 PTX, which an
    # arch-specific ('a') kernel never uses (wgmma/TMA need sm_90a) -- about a fifth of the build
    flags = [*NVCC_FLAGS, f"-gencode=arch={arch.replace('sm_', 'compute_')},code={arch}"]
    key = hashlib.sha256("\0".join([source, arch, *flags, *incs]).encode()).hexdigest()[:24]
    out_dir = cache_dir() / key
    lib = out_dir / "kernel.so"
    if lib.is_file() and os.access(lib, os.R_OK):
        return lib  # (one this uid cannot read, built before LIB_MODE by another worker, is built again below)
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / "kernel.cu"
    if not src.is_file():
        tmp_src = out_dir / f".kernel.{os.getpid()}.cu"
        tmp_src.write_text(source)
        os.replace(tmp_src, src)
    fd, tmp_lib = tempfile.mkstemp(prefix=".kernel.", suffix=".so", dir=out_dir)
    os.close(fd)
    cmd = [exe, *flags, *[f"-I{d}" for d in incs], "-o", tmp_lib, str(src)]
    env = {k: v for k, v in os.environ.items() if k not in _BUILD_ENV_DROP}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False, env=env)
    except subprocess.TimeoutExpired as e:
        Path(tmp_lib).unlink(missing_ok=True)
        raise RuntimeError(f"nvcc timed out after {BUILD_TIMEOUT_S:.0f} s") from e
    if proc.returncode != 0:
        Path(tmp_lib).unlink(missing_ok=True)
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or proc.stderr.splitlines()
        raise RuntimeError("nvcc failed:\n" + "\n".join(errors[:12])[-3000:])
    bad = sorted({n for n in _imported_symbols(tmp_lib) or [] if _SYMBOLS_FORBIDDEN.fullmatch(n)})
    if bad:
        Path(tmp_lib).unlink(missing_ok=True)
        raise CutlassSourceRefused(f"CUTLASS source refused: the library imports {', '.join(bad[:8])}")
    (out_dir / "build.log").write_text(proc.stderr)
    # mkstemp made the file 0600: readable by the uid that built it only. The guard's workers each run as
    # their own uid and share this cache through their role's group (guard/sandbox.py), so a library one
    # worker built and another loads must be group-readable: without this, every later load of a library
    # failed with "OSError: ... kernel.so: Permission denied" (softmax.cutlass_sm90's start point on the
    # H200, a compile_error in each of three searches). The folder's own mode (umask 007) keeps others out.
    os.chmod(tmp_lib, LIB_MODE)
    os.replace(tmp_lib, lib)
    return lib


def resource_usage(lib: Path) -> dict[str, int]:
    """Largest registers per thread and spill bytes over the library's kernels (from ptxas -v)."""
    log = Path(lib).with_name("build.log")
    text = log.read_text() if log.is_file() else ""
    regs = [int(m) for m in re.findall(r"Used (\d+) registers", text)]
    spills = [int(a) + int(b) for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)]
    return {"registers": max(regs, default=0), "spill_bytes": max(spills, default=0), "kernels": len(regs)}


class Kernel:
    """A built CUTLASS library with the KernelArc C ABI."""

    def __init__(self, path: Path):
        self.path = path
        self._lib = ctypes.CDLL(str(path))
        self._run = self._lib.kernelarc_run
        self._run.restype = ctypes.c_int
        self._run.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
        self._ws = self._lib.kernelarc_workspace
        self._ws.restype = ctypes.c_size_t
        self._ws.argtypes = [ctypes.c_void_p]
        self._ws_bytes: dict[tuple[int, ...], int] = {}  # workspace size per problem shape, asked once

    def __call__(self, inputs: list[Any], outputs: list[Any], dims: list[int]) -> None:
        import torch

        for t in (*inputs, *outputs):
            if not isinstance(t, torch.Tensor) or not t.is_cuda or not t.is_contiguous():
                raise ValueError("CUTLASS kernels take contiguous CUDA tensors")
        ins = (ctypes.c_void_p * len(inputs))(*[t.data_ptr() for t in inputs])
        outs = (ctypes.c_void_p * len(outputs))(*[t.data_ptr() for t in outputs])
        dim_arr = (ctypes.c_longlong * len(dims))(*dims)
        key = tuple(int(d) for d in dims)
        ws_bytes = self._ws_bytes.get(key)
        if ws_bytes is None:
            ws_bytes = self._ws_bytes[key] = int(self._ws(ctypes.cast(dim_arr, ctypes.c_void_p)))
        device = outputs[0].device
        ws = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device=device)
        stream = torch.cuda.current_stream(device).cuda_stream
        status = self._run(
            ctypes.cast(ins, ctypes.c_void_p),
            ctypes.cast(outs, ctypes.c_void_p),
            ctypes.cast(dim_arr, ctypes.c_void_p),
            ctypes.c_void_p(ws.data_ptr()),
            ctypes.c_void_p(stream),
        )
        if status != 0:
            raise RuntimeError(f"CUTLASS kernel failed with status {status} for dims {list(dims)}")


def load(source: str, arch: str = ARCH) -> Kernel:
    """Build (or reuse) and load a CUTLASS library; one handle per library per process."""
    lib = build(source, arch)  # a cache lookup once built
    with _LOCK:
        if str(lib) not in _LOADED:
            _LOADED[str(lib)] = Kernel(lib)
        return _LOADED[str(lib)]
