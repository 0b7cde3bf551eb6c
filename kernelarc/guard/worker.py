"""Isolated, single-use guard worker: runs one untrusted candidate and does what the judge says.

The worker is started ahead of time (torch imported, device initialised), takes exactly one
job, and exits. It executes the judge's commands one at a time (``protocol.Cmd``: warm up, a
checked call on inputs from a seed the judge sends only then, a timing burst, ...) and answers
each with one typed JSON message. It never sees reference outputs: it copies the candidate's
outputs into the judge's byte buffer (``buffers``) and the judge decides. It runs as its own
unprivileged user where the judge is root (``sandbox``), its stdout and stderr go to a log file,
and torch's and the harness's integrity is checked after every candidate call (``integrity``).

Timed inputs (``do_time``): the timing sets are the checked correctness sets of this job; before
every timed call the set about to be used gets new content in place: its plain random tensors are
drawn again, as ``make_inputs`` draws them (role and distribution), from a seed of os.urandom. So no
timed call sees content any earlier call saw, and no statistic tells an unchecked call's inputs from
the checked one's (a roll, used before, kept every order-independent statistic: an exact integer sum
of a small weight told the judge's fresh draw from the rolls). A burst's checked call gets a set
rewritten in place from a seed the judge staged just before that burst (os.urandom, unknown until
then); outputs are poisoned before every call, checked or not, so a checked call looks like any
other. Inputs that keep their content between calls (masks, tables, custom and file inputs) are
fingerprinted before a burst and after it: a candidate that writes into them during timed calls (a
mark that survives the unchecked calls but not the checked call's refill) is ``rejected_hack``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from typing import Any

from kernelarc.guard.protocol import (
    Channel,
    Cmd,
    Done,
    Fail,
    FailStatus,
    Imported,
    Kind,
    Ok,
    OutputMeta,
    Outputs,
    Ready,
    Tag,
    Timing,
)

# Captured before any candidate code exists in this process; the harness only calls these.
_perf_counter = time.perf_counter

# Audit events a candidate's own code may never raise (``_install_audit``): what the static checks forbid, caught
# again at run time however it was reached (a third red team reached exec through ``enum.bltns``).
_AUDIT_BLOCKED = frozenset({
    "exec", "compile", "sys._getframe", "sys._current_frames", "sys.settrace", "sys.setprofile", "open",
    "os.system", "os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg",
    "subprocess.Popen", "ctypes.dlopen", "ctypes.dlsym", "ctypes.addressof", "ctypes.string_at", "ctypes.cdata",
    "ctypes.call_function", "socket.connect", "socket.bind", "socket.sendto", "mmap.__new__", "gc.get_objects",
    "gc.get_referrers", "gc.get_referents", "code.__new__", "function.__new__", "pickle.find_class",
    # the environment: compilers read it (NVCC_PREPEND_FLAGS took a red team's flags past the C++ check)
    "os.putenv", "os.unsetenv",
})  # fmt: skip
# what an installed library may set in the environment for the candidate (torch.cuda's lazy start)
_AUDIT_ENV_KEYS = frozenset({"CUDA_MODULE_LOADING"})
# Compilers whose own code may do what a candidate may not (Dynamo and Inductor, Triton, the CUTLASS build), relative
# to the installed libraries (``_audit_places``): a frame shields the candidate's below it only from these files.
_AUDIT_MACHINERY = ("torch/_dynamo/", "torch/_inductor/", "torch/_functorch/", "triton/", "kernelarc/cutlass.py")
# What an installed library may do when the candidate calls it (no compiler between), of ``_AUDIT_BLOCKED``: load and
# call native libraries (torch.cuda reaches NVML through ctypes: run G2, 40 honest Triton candidates rejected), read
# installed files, look at its callers' frames (typing, typing_extensions), set ``_AUDIT_ENV_KEYS``. Not: run code
# (timeit's and the unpickler's exec), start processes, open sockets, walk the heap, trace, map memory, read other
# files (linecache read a red team's /proc/self/cmdline into a warning), write files or set the environment
# (compilers read it); nor hand frames to the candidate (inspect, traceback and logging's helpers,
# ``_AUDIT_FRAME_GIVERS``, called by the candidate's code; called by a library's, as logging's findCaller is for any
# warning logged, they may). Code without an installed file (exec'd text, a module under a temp or cache folder)
# gets nothing.
_AUDIT_LIBRARY_MAY = frozenset({
    "ctypes.dlopen", "ctypes.dlsym", "ctypes.addressof", "ctypes.string_at", "ctypes.cdata", "ctypes.call_function",
    "sys._getframe",
})  # fmt: skip
_AUDIT_FRAME_GIVERS = ("inspect.py", "traceback.py", "logging/__init__.py")
# Library code that raises a blocked event for reasons of its own, with nothing the candidate gives it in what the
# event does (the frame raising it: file relative to the installed libraries, function): namedtuple's generated
# __new__ (its field names are checked identifiers) and its caller's module name, typing's and enum's caller's module
# name, torch.library's record of where an op was defined (a frame read, never handed out).
_AUDIT_BENIGN = frozenset({
    ("exec", "collections/__init__.py", "namedtuple"), ("compile", "collections/__init__.py", "namedtuple"),
    ("sys._getframe", "collections/__init__.py", "namedtuple"), ("sys._getframe", "typing.py", "_caller"),
    ("sys._getframe", "enum.py", "_create_"), ("sys._getframe", "torch/_library/utils.py", "get_source"),
    ("sys._getframe", "torch/library.py", "__init__"), ("sys._getframe", "torch/library.py", "_register_fake"),
})  # fmt: skip


def _audit_places() -> tuple[tuple[tuple[str, str], ...], tuple[str, ...]]:
    """(installed, scratch): where the interpreter, its standard library, the installed packages, torch, Triton and
    KernelArc live, as (root, prefix) pairs (a file under ``prefix`` is installed, named relative to ``root``), and
    where anyone may write files (the temp folders, the caches: Inductor's and Triton's generated code,
    PyCodeCache.load's modules, a candidate's files), as folder prefixes. A root under scratch space counts only for
    a package's own folder (KernelArc checked out under /tmp); the longer match decides (Inductor's cache under /tmp
    is not installed, KernelArc's folder under it is)."""
    import site
    import sysconfig
    import tempfile

    def folder(p: str) -> str:
        return os.path.join(os.path.normpath(os.path.abspath(p)), "")

    home = os.path.expanduser("~")  # not itself scratch: an interpreter may be installed under it (pyenv)
    scratch = {tempfile.gettempdir(), "/tmp", "/var/tmp", "/dev/shm", os.path.join(home, ".cache"),
               os.path.join(home, ".triton"), os.environ.get("TMPDIR"), os.environ.get("XDG_CACHE_HOME"),
               os.environ.get("TORCHINDUCTOR_CACHE_DIR"), os.environ.get("TRITON_CACHE_DIR")}  # fmt: skip
    scr = {folder(p) for p in scratch if p}
    roots = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    roots |= {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    with contextlib.suppress(Exception):
        roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    pairs = {(folder(p), folder(p)) for p in roots if p and not any(folder(p).startswith(s) for s in scr)}
    # The import path as the worker starts, before any candidate code: packages installed with --target into a folder
    # under /tmp (the device's wheels in /tmp/site: run G2 rejected 40 honest candidates as hacks, typing_extensions
    # and the CUDA libraries' loaders counted as scratch). Not the working folder, nor a temp folder itself.
    cwd = folder(os.getcwd())
    for p in sys.path:
        if p and os.path.isabs(p) and os.path.isdir(p) and folder(p) != cwd and folder(p) not in scr:
            pairs.add((folder(p), folder(p)))
    for mod in ("torch", "triton", "kernelarc"):
        if (m := sys.modules.get(mod)) is not None and getattr(m, "__file__", None):
            pkg = os.path.dirname(m.__file__)
            pairs.add((folder(os.path.dirname(pkg)), folder(pkg)))
    return tuple(sorted(pairs)), tuple(sorted(scr))


def _audit_hits() -> tuple[str, ...]:
    """What the runtime audit refused so far (none: no audit installed; ``_install_audit`` rebinds this name to the
    reader of its own record, before the integrity snapshot, which watches the binding and its code)."""
    return ()


def _install_audit() -> None:
    """An audit hook (never removable) that refuses the events of ``_AUDIT_BLOCKED`` raised for the candidate: where
    a candidate frame (``kernelarc_candidate_<digest>.py``, as ``load_module`` names it) is on the stack below the
    event and no compiler's frame (``_AUDIT_MACHINERY``, a file of the installed torch or Triton) sits between the
    event and the nearest candidate frame. Whatever else sits between is the candidate's proxy, not a shield: code in
    files under a temp or cache folder (PyCodeCache.load imported a red team's text as a module with a file of its
    own) or without a file gets no blocked event; an installed library only those of ``_AUDIT_LIBRARY_MAY`` (native
    code, a look at its caller: not timeit's exec of a red team's text, nor torch.load's unpickler calling exec).
    Exempt:
    an import of an installed module (importlib's reads, compile and exec of its file, and what its body does), a
    read of an installed file or of the candidate's own source (linecache for a warning), and ``_AUDIT_BENIGN``. A
    refused event raises in the candidate and is recorded; ``fail_if_tampered`` then rejects the job as a hack.

    Its state lives in this closure, never in a module global: a thirty-third red team's code, exec'd by
    torch.utils.benchmark.Timer from timeit's frames, switched the audit off through the worker's writable
    ``_AUDIT["on"]``. Installed is on; the blocked events, compilers and places are the values seen here."""
    global _audit_hits
    getframe, basename, normpath, join = sys._getframe, os.path.basename, os.path.normpath, os.path.join
    blocked, benign = frozenset(_AUDIT_BLOCKED), frozenset(_AUDIT_BENIGN)
    library_events, giver_files = frozenset(_AUDIT_LIBRARY_MAY), tuple(_AUDIT_FRAME_GIVERS)
    env_keys = frozenset(_AUDIT_ENV_KEYS)
    installed, scratch = _audit_places()
    machinery = tuple(join(root, m) for root, _ in installed for m in _AUDIT_MACHINERY)
    write_flags = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    places: dict[str, tuple[str, str]] = {}  # file name -> (kind, path relative to its installed root)
    hits: list[str] = []
    busy = [False]  # sys._getframe raises an event of its own

    def place(name: str) -> tuple[str, str]:
        """("candidate" | "machinery" | "installed" | "frozen" | "untrusted", relative path) of a code file name."""
        got = places.get(name)
        if got is None:
            if basename(name).startswith("kernelarc_candidate_"):
                got = ("candidate", "")
            elif name.startswith("<frozen "):
                got = ("frozen", name)
            elif name.startswith("<") or not name.startswith("/"):
                got = ("untrusted", "")  # exec'd text: code without a file of its own
            else:
                path = normpath(name)
                root, pre = max(((r, p) for r, p in installed if path.startswith(p)), key=lambda rp: len(rp[1]),
                                default=("", ""))  # fmt: skip
                tmp = max((r for r in scratch if path.startswith(r)), key=len, default="")
                if not pre or len(tmp) > len(pre):
                    got = ("untrusted", "")
                elif path.startswith(machinery):
                    got = ("machinery", path[len(root) :])
                else:
                    got = ("installed", path[len(root) :])
            if len(places) < 100_000:
                places[name] = got
        return got

    def writing(args: tuple) -> bool:
        """Whether an ``open`` event's (path, mode, flags) may write (or names no path: a file descriptor)."""
        path, mode, flags = (tuple(args) + (None, None, None))[:3]
        if not isinstance(path, str):
            return True
        if mode is not None:
            return any(c in str(mode) for c in "wax+")
        return not isinstance(flags, int) or bool(flags & write_flags)

    def exempt(event: str, args: tuple, frame) -> bool:
        kind, rel = place(frame.f_code.co_filename)
        if (event, rel, frame.f_code.co_name) in benign and kind == "installed":
            return True
        if event == "open":  # (path, mode, flags): a read of an installed file or of the candidate's own source
            path = args[0] if args else None
            return not writing(args) and place(path if path.startswith("/") else os.path.abspath(path))[0] in (
                "installed", "machinery", "frozen", "candidate")  # fmt: skip
        if kind == "frozen" and frame.f_code.co_filename.startswith("<frozen importlib"):
            # importlib compiling or running an installed module's file (a lazy import inside torch)
            if event == "compile" and len(args) > 1 and isinstance(args[1], str):
                return place(args[1])[0] in ("installed", "machinery")
            if event == "exec" and args and hasattr(args[0], "co_filename"):
                return place(args[0].co_filename)[0] in ("installed", "machinery")
        return False

    def library_may(event: str, args: tuple, frame) -> bool:
        """Whether an installed library's frame may raise ``event`` for the candidate (``_AUDIT_LIBRARY_MAY``; a read
        of an installed file or of the candidate's source is ``exempt`` already, any other file is not)."""
        if event in ("os.putenv", "os.unsetenv"):
            key = args[0] if args else None
            key = key.decode(errors="replace") if isinstance(key, bytes) else key
            return key in env_keys
        # a helper that hands a frame out (inspect, traceback, logging) may do so to a library's code, never to the
        # candidate's or to code without an installed file (the frame goes to the helper's caller: the candidate's
        # inspect.currentframe() is refused, its logging.warning() is not: logging's currentframe hands the frame to
        # findCaller, which returns strings)
        if event == "sys._getframe" and place(frame.f_code.co_filename)[1].endswith(giver_files):
            up = frame.f_back
            if up is None or place(up.f_code.co_filename)[0] in ("candidate", "untrusted"):
                return False
        return event in library_events

    def verdict(event: str, args: tuple) -> str | None:
        frame = getframe(2)
        f, via, untrusted = frame, None, False
        while f is not None:
            kind, _ = place(f.f_code.co_filename)
            if kind == "candidate":
                break
            if kind == "machinery":
                return None
            if (
                kind == "installed"
                and f.f_code.co_name == "<module>"
                and place(f.f_back.f_code.co_filename)[0] == "frozen"
            ):
                return None  # the body of an installed module being imported (a lazy import): the library's own code
            untrusted = untrusted or kind == "untrusted"
            if via is None and kind != "frozen":
                via = f.f_code.co_filename
            f = f.f_back
        if f is None or exempt(event, args, frame):
            return None
        if via is None:
            return f"{event} from the candidate's code (line {f.f_lineno})"
        if not untrusted and library_may(event, args, frame):
            return None  # an installed library's own use (NVML through ctypes, typing's look at its caller)
        return f"{event} from {basename(via)} called by the candidate's code (line {f.f_lineno})"

    def hook(event: str, args: tuple) -> None:
        if event not in blocked or busy[0]:
            return
        busy[0] = True
        try:
            why = verdict(event, args)
        finally:
            busy[0] = False
        if why:
            hits.append(why)
            raise RuntimeError(f"{event} is not allowed in a candidate (refused by the harness)")

    def recorded() -> tuple[str, ...]:
        return tuple(hits)

    sys.addaudithook(hook)
    _audit_hits = recorded


def _audit_failure() -> CandidateFailure | None:
    """The job's verdict once the audit refused an event (None: it refused none)."""
    hits = _audit_hits()
    if not hits:
        return None
    return CandidateFailure("rejected_hack", "runtime audit: " + "; ".join(hits[:3]))


# Helper threads that torch itself starts (Inductor's compile machinery, its progress bar):
# candidates cannot import threading (static check), so these names come from torch. They are
# exempt only until the first call ends: NVIDIA's harness takes its thread count after the first call
# on each workload and judges any thread more after its later calls and timing as REWARD_HACK
# ("Thread injection detected"), torch's included (Inductor's compile-pool timer thread starts
# seconds after the first compile: two exported champions failed so on the H200). See ``_no_strays``.
TORCH_THREADS = frozenset({"InductorSubproc", "tqdm_monitor", "subproc_worker_timer"})


def _start_tqdm_monitor() -> None:
    """Start tqdm's monitor thread now, as the harness's own thread.

    tqdm starts one monitor thread on its first instance, even a disabled one, and keeps it to the end of
    the process. Inductor creates a disabled tqdm whenever it waits for its parallel kernel compiles. A
    candidate that compiles a graph only after the first call (a shape dispatch whose first part is eager
    and whose second is compiled, on the H200) would start the monitor then, and the thread-count rule
    (``_no_strays``) would read that as thread injection. NVIDIA's harness takes a baseline per workload,
    after that workload's first call, and passes such a candidate. The thread runs no candidate code, and
    with it started here no candidate call can start it."""
    try:
        from tqdm import tqdm
    except Exception:  # noqa: BLE001 - no tqdm: Inductor uses its own stand-in, which starts no thread
        return
    with contextlib.suppress(Exception):  # not started: the rule stays as strict as before
        tqdm(disable=True).close()


class CandidateFailure(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _trim(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2 :]


def _text(read: Any) -> str:
    """What ``read()`` gives, as an exact str; a failure of it (code of the candidate's, raising) as a placeholder, so
    that formatting a candidate's exception never raises out of ``_classify``."""
    try:
        got = read()
        return str.__str__(got) if issubclass(type(got), str) else "<not a str>"  # a str subclass: as a plain str
    except BaseException:  # noqa: BLE001 - the candidate's code, failing however it likes
        return "<unreadable>"


def _classify(exc: BaseException) -> CandidateFailure:
    import torch

    if refused := _audit_failure():  # whatever the candidate made of the refusal, what it tried is the verdict
        return refused
    from kernelarc.guard.timer import NotPlainResult

    # By type, never isinstance (which asks a failing check for the object's __class__), and the exception's text
    # taken once as an exact str (its __str__ is the candidate's where the candidate raised it, and a str subclass's
    # lower() would be too). Whatever that code does, the verdict is a failure: it cannot make a call pass.
    kind = type(exc)
    # a result container read after the clock runs the candidate's code; C++ that reaches past its kernel
    cutlass = sys.modules.get("kernelarc.cutlass")
    if issubclass(kind, (NotPlainResult, *([cutlass.CutlassSourceRefused] if cutlass is not None else []))):
        return CandidateFailure("rejected_hack", BaseException.__str__(exc))
    name = _text(lambda: kind.__name__)
    text = _text(lambda: str(exc))
    msg = f"{name}: {text}"
    tb = _trim(_text(lambda: "".join(traceback.format_exception(exc)))[-3000:])
    if issubclass(kind, torch.OutOfMemoryError) or "out of memory" in text.lower():
        return CandidateFailure("runtime_error", f"out of memory: {_trim(text, 500)}")
    mod = _text(lambda: kind.__module__ or "")
    if (
        "Compil" in name
        or "triton.compiler" in mod
        or name in ("CompileTimeAssertionFailure", "UnsupportedLanguageConstruct")
    ):
        return CandidateFailure("compile_error", _trim(msg + "\n" + tb))
    return CandidateFailure("runtime_error", _trim(msg + "\n" + tb))


def _children() -> list[int]:
    """Live (not zombie) child processes of this worker: from ``/proc/self/task/*/children`` (one small
    read per thread) where the kernel has it, else from a scan of every process's ``stat``, which on a
    host of many processes cost milliseconds after every timed burst."""
    me = str(os.getpid())
    listed: list[int] | None = []
    try:
        for t in os.listdir("/proc/self/task"):
            with open(f"/proc/self/task/{t}/children") as f:
                listed += [int(p) for p in f.read().split()]
    except (OSError, ValueError):
        listed = None
    kids = []
    try:
        for pid in os.listdir("/proc") if listed is None else map(str, listed):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if fields[1] == me and fields[0] != "Z":
                    kids.append(int(pid))
            except OSError:
                continue
    except OSError:
        pass
    return kids


class Harness:
    """Executes the judge's commands for one job (see ``protocol.Cmd``); the judge decides everything."""

    profile: StepProfile | None = None  # the harness's own profiler (KERNELARC_PROFILE_DIR), set before serve()
    bench_lock: Any = None  # benchlock.BenchLock where the judge passed its descriptors, set before serve()

    def __init__(self, chan: Channel, job: dict[str, Any], mapped: tuple | None = None):
        import threading

        import torch

        from kernelarc.guard import buffers, integrity, protocol, sandbox, timer
        from kernelarc.tasks import inputs as inputs_mod
        from kernelarc.tasks import loader
        from kernelarc.tasks.inputs import load_module, make_inputs, refill, snapshot, torch_dtype
        from kernelarc.tasks.loader import load_task

        self.torch = torch
        from torch.autograd.graph import increment_version

        self.increment_version = increment_version  # bound before any candidate code runs (_version_step)
        self.tensor_dict_get = torch.Tensor.__dict__["__dict__"].__get__  # an output's own attributes (_validate)
        self.chan = chan
        self.job = job
        self.device = torch.device(job["device"])
        self.is_cuda = self.device.type == "cuda"
        if job.get("cpu_threads"):  # the judge's share of the cores for this worker (Guard.cpu_threads)
            torch.set_num_threads(int(job["cpu_threads"]))
        self.task = load_task(job["task_path"], workload_file=job["workload_file"])
        if not job.get("jitter", True):  # the judge's reference failed on scaled draws: as the judge draws them
            from kernelarc.tasks.inputs import JITTER_OFF

            JITTER_OFF.add(str(self.task.path))
        self.make_inputs = make_inputs
        self.refill, self.snapshot = refill, snapshot
        from kernelarc.tasks.inputs import share_elements

        self.share_elements = share_elements
        self.load_module = load_module
        self.torch_dtype = torch_dtype
        self.out_specs = list(self.task.definition.outputs.items())
        self.layout = buffers.layout
        self.view = buffers.view
        self.scalar, self.scalar_values = buffers.scalar, buffers.scalar_values
        self.role_of = getattr(inputs_mod, "role_of", None)
        self.warnings: list[str] = []
        self.phases: dict[str, float] = {}
        # Mapped while still privileged (the judge's buffer file is its own), then the uid drop.
        if mapped is not None and tuple(job["buffer"]) == mapped[0]:
            self.buf = mapped[1]  # the pool's buffer, mapped (and page-locked) while the worker started
        else:
            # page-locked before the uid drop and its limits: DMA-speed output copies
            self.buf = buffers.open_buffer(job["buffer"], page_lock=str(job["device"]).startswith("cuda"))
        self.warnings += sandbox.enter(sandbox.Role(job["role"]), job.get("uid"), job["home"], job["tmp"])
        self.threading = threading
        _start_tqdm_monitor()
        self.threads0 = {t.ident for t in threading.enumerate()}
        # Candidate threads alive after the first call (NVIDIA's baseline, see _no_strays); None until
        # then, while only the name rule applies.
        self.thread_base: dict[int | None, str] | None = None
        self.random_tensor, self.distribution_for = inputs_mod.random_tensor, inputs_mod.distribution_for
        self.sets: dict[int, list[list[Any]]] = {}
        self.held: dict[int, list[Any]] = {}
        # Per workload, the inputs for the next checked timed call. A set stays allocated from the workload's
        # first timed command on (a throw-away one until the judge stages), so that the device memory in use
        # (torch.cuda.memory_allocated) is the same in checked and unchecked bursts: a kernel cannot tell them.
        self.staged: dict[int, list[Any]] = {}
        self.fresh: set[int] = set()  # workloads whose staged set came from the judge and is not used yet
        self.uses: dict[int, int] = {}
        self.fn: Any = None
        self.cand_files: set[str] = set()  # the candidate module's file (threads running its code)
        self.timer: Any = None
        self.timer_mod = timer
        if job.get("audit"):  # before the integrity snapshot: it watches the audit's reader (``_audit_hits``)
            _install_audit()
        self.integrity = integrity.Integrity(
            [sys.modules[__name__], protocol, buffers, integrity, timer, sandbox, inputs_mod, loader]
        )
        # the harness's constants that are data (the module check above watches callables only)
        self.integrity.watch_globals(
            sys.modules[__name__],
            (
                "_AUDIT_BLOCKED",
                "_AUDIT_MACHINERY",
                "_AUDIT_BENIGN",
                "_AUDIT_LIBRARY_MAY",
                "_AUDIT_FRAME_GIVERS",
                "_AUDIT_ENV_KEYS",
                "TORCH_THREADS",
            ),
        )
        self.integrity.watch_globals(
            timer, ("_CONTAINER_METHODS", "_ANY_CONTAINER", "_C_METHODS", "_ATOMS", "_SEQUENCES", "_FUNCTION_KINDS")
        )
        self._full, self._quick = integrity.Integrity.full, integrity.Integrity.quick

    # -- messaging ---------------------------------------------------------------------
    def send(self, msg: Any) -> None:
        self.chan.send_message(msg)

    def fail_if_tampered(self, full: bool = True) -> None:
        if refused := _audit_failure():
            raise refused
        # through the class's functions taken at the start (an instance attribute could shadow them)
        msg = self._full(self.integrity) if full else self._quick(self.integrity)
        if msg:
            raise CandidateFailure("rejected_hack", msg)

    # -- checks around one call ----------------------------------------------------------
    def _sync(self) -> None:
        if self.is_cuda:
            self.torch.cuda.synchronize(self.device)

    def _poison(self, wl: int) -> None:
        """Leave poisoned blocks in the allocator so an output nobody writes is never a stale result."""
        torch = self.torch
        keep = []
        for name, spec in self.out_specs:
            shape = self.task.shape(name, wl)
            if shape is None:
                continue
            dt = self.torch_dtype(spec.dtype)
            t = torch.empty(shape, dtype=dt, device=self.device)
            if dt.is_floating_point:
                t.fill_(float("nan"))
            elif dt == torch.bool:
                t.fill_(True)
            else:
                t.fill_(-7)
            keep.append(t)
        del keep

    def _normalize(self, result: Any, wl: int) -> list[Any]:
        n = len(self.out_specs)
        try:
            items = self.timer_mod.plain_items(result)  # through the base type's methods: no candidate code runs
        except self.timer_mod.NotPlainResult as e:
            raise CandidateFailure("rejected_hack", str(e)) from None
        if isinstance(items, dict):
            missing = [k for k, _ in self.out_specs if k not in items]
            if missing:
                raise CandidateFailure("incorrect", f"returned dict lacks outputs {missing}")
            outs = [items[k] for k, _ in self.out_specs]
        elif items is not None:
            if len(items) != n:
                raise CandidateFailure("incorrect", f"returned {len(items)} outputs, expected {n}")
            outs = items
        elif n != 1:
            raise CandidateFailure("incorrect", f"returned 1 output, expected {n}")
        else:
            outs = [result]
        return self.scalar_values(self.task, wl, outs)  # read after the call like any output

    def _hung(self, t: Any) -> list[str]:
        """What the candidate hung on a plain torch.Tensor (an output, or an input it was handed) that is not plain
        data (``timer.plain_data``): a finaliser that runs when the harness drops it, methods that run when the
        harness reads it (a dict subclass's items(), a function shadowing a tensor method: ``x.copy_ = f`` on an
        input ran in the next timed call's untimed set-up, with its new content), all outside the clock. Read
        through torch.Tensor's own ``__dict__`` descriptor and dict's own methods; torch's own bookkeeping
        (Dynamo's sets of ints) is plain data."""
        attrs = self.tensor_dict_get(t)
        if type(attrs) is not dict:  # a dict subclass set as the tensor's whole __dict__
            return ["__dict__"]
        if not attrs:
            return []
        plain, name = self.timer_mod.plain_data, self.timer_mod.type_name
        return sorted(k if type(k) is str else f"<a key of type {name(type(k))}>"
                      for k, v in dict.items(attrs) if type(k) is not str or not plain(self.torch, v))  # fmt: skip

    def _inputs_plain(self, inputs: list[Any]) -> None:
        """No input tensor carries anything of the candidate's (``_hung``): checked after every call and burst,
        before the harness reads the inputs (the mutation check, the fingerprints)."""
        for i, x in enumerate(inputs):
            if type(x) is self.torch.Tensor and (hung := self._hung(x)):
                raise CandidateFailure("rejected_hack", f"input {i} carries Python objects of the candidate's: {hung}")

    def _storage_span(self, t) -> tuple[int, int]:
        st = t.untyped_storage()
        return st.data_ptr(), st.data_ptr() + st.nbytes()

    def _validate(self, wl: int, outs: list[Any], inputs: list[Any], held: list[Any]) -> None:
        torch = self.torch
        in_spans = [self._storage_span(x) for x in inputs if isinstance(x, torch.Tensor)]
        held_spans = [self._storage_span(x) for x in held if isinstance(x, torch.Tensor)]
        spans = []
        for (name, spec), o in zip(self.out_specs, outs, strict=True):
            shape = self.task.shape(name, wl)
            if shape is None:
                if not self.timer_mod.plain_scalar(o):  # by type: no __float__ / __index__ of the candidate's runs
                    got = self.timer_mod.type_name(type(o))
                    raise CandidateFailure("incorrect", f"output {name}: expected a Python scalar, got {got}")
                continue
            if type(o) is not torch.Tensor:
                raise CandidateFailure(
                    "rejected_hack",
                    f"output {name}: {self.timer_mod.type_name(type(o))} is not a plain torch.Tensor",
                )
            if hung := self._hung(o):
                raise CandidateFailure("rejected_hack", f"output {name} carries Python objects in {hung}")
            if o.device != self.device:
                raise CandidateFailure("incorrect", f"output {name}: on {o.device}, expected {self.device}")
            if tuple(o.shape) != tuple(shape):
                raise CandidateFailure("incorrect", f"output {name}: shape {tuple(o.shape)}, expected {tuple(shape)}")
            want = self.torch_dtype(spec.dtype)
            if o.dtype != want:
                raise CandidateFailure("incorrect", f"output {name}: dtype {o.dtype}, expected {want}")
            if o.numel() == 0:
                continue
            lo, hi = self._storage_span(o)
            for a, b in in_spans:
                if lo < b and a < hi:
                    raise CandidateFailure(
                        "rejected_hack", f"output {name} aliases an input (returns or views an input)"
                    )
            for a, b in held_spans:
                if lo < b and a < hi:
                    raise CandidateFailure(
                        "rejected_hack", f"output {name} reuses an earlier output (cached across calls)"
                    )
            # Element-wise: outputs that are disjoint views of one buffer (split/chunk) are fine.
            if any(self.share_elements(o, prev) for prev in spans):
                raise CandidateFailure("incorrect", f"output {name} overlaps another output")
            spans.append(o)

    def _inputs_unchanged(self, inputs: list[Any], pristine: list[Any]) -> bool:
        torch = self.torch
        for x, p in zip(inputs, pristine, strict=True):
            if isinstance(x, torch.Tensor):
                if x.shape != p.shape or x.dtype != p.dtype:
                    return False
                # reshape(-1): a 0-d tensor cannot be viewed as bytes
                if not torch.equal(x.reshape(-1).view(torch.uint8), p.reshape(-1).view(torch.uint8)):
                    return False
        return True

    def call(self, fn, inputs: list[Any], warm: bool = False) -> Any:
        try:
            result = fn(*inputs)
            self._sync()
        except CandidateFailure:
            raise
        except BaseException as e:  # noqa: BLE001 - any candidate failure is a verdict
            if issubclass(type(e), KeyboardInterrupt | SystemExit):  # by type: isinstance could ask e.__class__
                raise CandidateFailure("rejected_hack", f"candidate raised {type(e).__name__}") from None
            raise _classify(e) from None
        # Before the harness makes any torch call of its own: no mode or hook may be waiting for it. The
        # full check (dispatcher, namespaces, harness code) runs before the outputs leave (emit).
        self.fail_if_tampered(full=False)
        self._inputs_plain(inputs)
        self._no_strays(warm=warm)
        return result

    def _candidate_threads(self) -> dict[int | None, str]:
        """Threads alive now that the harness did not start (its own, CUPTI's buffer thread included)."""
        return {t.ident: t.name for t in self.threading.enumerate() if t.ident not in self.threads0}

    def _no_strays(self, warm: bool = False) -> None:
        """No thread or process of the candidate's outlives a call.

        Threads of any name other than torch's are rejected whenever they appear. torch's own helpers
        may start at import and during the first call, as NVIDIA's harness allows them in its first call
        on a workload (its baseline). After that call the rule is NVIDIA's: more threads alive than
        after it (any name, torch's included) is thread injection, whatever started them. The baseline
        is the job's first call, not each workload's: NVIDIA runs a workload's ten rounds and timing
        before the next workload's first call, where the judge warms up every workload first, so a
        helper thread that starts seconds after the first call (Inductor's compile-pool timer) would
        otherwise hide in a later warm-up."""
        alive = self._candidate_threads()
        extra = [name for name in alive.values() if name not in TORCH_THREADS]
        extra += [f"{name} (named like torch's, running the candidate's code)" for ident, name in alive.items()
                  if name in TORCH_THREADS and self._runs_candidate_code(ident)]  # fmt: skip
        if extra:
            names = ", ".join(extra)
            raise CandidateFailure("rejected_hack", f"candidate started threads that outlive the call: {names}")
        if self.thread_base is None:
            if warm:
                self.thread_base = alive
        elif len(alive) > len(self.thread_base):
            new = [name for ident, name in alive.items() if ident not in self.thread_base] or list(alive.values())
            raise CandidateFailure(
                "rejected_hack",
                f"thread injection: {len(alive)} candidate thread(s) alive after a later call vs "
                f"{len(self.thread_base)} after the first (new: {', '.join(new)}); NVIDIA's harness counts "
                "threads after its first call on a workload and after timing, torch's own included, and "
                "rejects any increase as REWARD_HACK",
            )
        if _children():
            raise CandidateFailure("rejected_hack", "candidate started processes that outlive the call")

    def _runs_candidate_code(self, ident: int | None) -> bool:
        """Whether the thread's target (or any function of its class: ``run``, a ``name`` property) is defined in the
        candidate's source: a red team's thread named like Inductor's helper was taken for torch's and never
        counted."""
        files = self.cand_files
        t = next((t for t in self.threading.enumerate() if t.ident == ident), None)
        if t is None or not files:
            return False
        import functools
        import types

        # Read by exact type, never by attribute lookups on the target (an object of the candidate's could answer
        # ``.func`` with its own code, after the clock, and name a function of torch's). A target of any other type
        # (a callable object) counts by its class's functions.
        attrs = self.threading.Thread.__dict__["__dict__"].__get__(t)  # Thread's own descriptor, not t.__dict__
        target = dict.get(attrs, "_target") if type(attrs) is dict else None
        for _ in range(4):  # functools.partial and bound methods around it
            if type(target) is functools.partial:
                target = target.func
            elif type(target) is types.MethodType:
                target = target.__func__
        fns = [target] if type(target) is types.FunctionType else []
        for k in {type(t), type(target)}:
            fns += self.timer_mod.class_functions(k)  # a Thread subclass's run, name, ident; a callable's __call__
        return any(f.__code__.co_filename in files for f in fns)

    def _no_daemons(self) -> None:
        """Processes of this worker that are not its children (double-forked, setsid): the judge kills
        them after the job whatever happens, and their existence is a verdict."""
        from kernelarc.guard.sandbox import Identity, Sandbox, find_processes

        me = os.getpid()
        ident = Identity(self.job.get("uid"), os.environ.get("KERNELARC_WORKER_TOKEN", "-"), self.job["tmp"])
        strays = find_processes(ident, me, Sandbox.start_ticks(me), me)
        if strays:
            raise CandidateFailure("rejected_hack", f"candidate left {len(strays)} process(es) running (daemons)")

    def emit(self, tag: Tag, wl: int, outs: list[Any], like: list[Any] | None = None) -> Outputs:
        """Copy the outputs into the judge's buffer, in the judge's layout; say what they looked like (``like``:
        the call's own outputs, where ``outs`` holds a copy of their values: the layout reported is theirs)."""
        torch = self.torch
        self.fail_if_tampered()
        metas = []
        for i, (slot, o) in enumerate(zip(self.layout(self.task, wl), outs, strict=True)):
            if slot.shape is None:
                metas.append(OutputMeta(name=slot.name, scalar=self.scalar(o)))
                continue
            self.view(self.buf, slot).copy_(o)
            dtype = str(o.dtype).removeprefix("torch.")
            strides = list((o if like is None else like[i]).stride())
            metas.append(OutputMeta(name=slot.name, shape=list(o.shape), strides=strides, dtype=dtype))
        self._sync()
        del torch
        return Outputs(kind=Kind.outputs, tag=tag, wl=wl, outputs=metas)

    def _note_cutlass_builds(self, module: Any) -> None:
        """Registers and spills of the CUTLASS libraries a candidate built (from ptxas), as verdict notes."""
        if "kernelarc.cutlass" not in sys.modules:
            return
        from kernelarc.cutlass import Kernel, resource_usage

        for value in list(module.__dict__.values()):
            if isinstance(value, Kernel):
                u = resource_usage(value.path)
                self.warnings.append(
                    f"cutlass build: {u['kernels']} kernel(s), up to {u['registers']} registers/thread, "
                    f"{u['spill_bytes']} spill bytes"
                )

    # -- commands ------------------------------------------------------------------------
    def serve(self) -> None:
        # the harness's objects, as they are before any candidate code runs (attributes the harness itself sets
        # later are mutable; the timer is watched once it exists)
        self.integrity.watch("harness", self, {"timer", "fn", "thread_base", "cand_files"})
        self.integrity.watch("channel", self.chan, {"_buf"})
        self.integrity.watch("integrity", self.integrity, {"n_impls", "impls0"})
        handlers = {
            Cmd.warmup: self.do_warmup,
            Cmd.check: self.do_check,
            Cmd.prepare: self.do_prepare,
            Cmd.reuse: self.do_reuse,
            Cmd.stage: self.do_stage,
            Cmd.time: self.do_time,
        }
        prof = self.profile
        self.do_import()
        while True:
            if prof is not None:
                prof.flush()
            cmd = self.chan.recv_command()
            kind = cmd.pop("cmd")
            if kind is Cmd.end:
                self.fail_if_tampered()
                self._no_strays()  # a helper thread that started late (after the last call) counts too
                self._no_daemons()
                self.send(Done(kind=Kind.done, phases=self.phases, warnings=self.warnings[:64]))
                return
            t0 = _perf_counter()
            self.send(handlers[kind](**cmd))
            phase = {Cmd.warmup: "compile", Cmd.time: "timing", Cmd.stage: "timing"}.get(kind, "correctness")
            self.phases[phase] = self.phases.get(phase, 0.0) + _perf_counter() - t0

    def do_import(self) -> None:
        job = self.job
        t0 = _perf_counter()
        try:
            cand = self.load_module(job["source"], "candidate")
        except SyntaxError as e:
            raise CandidateFailure("compile_error", f"SyntaxError line {e.lineno}: {e.msg}") from None
        except BaseException as e:  # noqa: BLE001
            self.fail_if_tampered(full=False)  # an event the audit refused at import: a hack, not a compile error
            f = _classify(e)
            if f.status == "rejected_hack":  # refused at import (C++ that reaches past its kernel): the verdict stands
                raise f from None
            raise CandidateFailure("compile_error", f"import failed: {f.message}") from None
        fn = getattr(cand, "run", None)
        if not callable(fn):
            raise CandidateFailure("compile_error", "module defines no callable run()")
        self.fail_if_tampered()
        self._no_strays()
        self.fn = fn
        self.cand_files = {getattr(cand, "__file__", None)} - {None}
        self.phases["import"] = _perf_counter() - t0
        self._note_cutlass_builds(cand)
        self.send(Imported(kind=Kind.imported, notes=self.warnings[:64]))

    def do_warmup(self, wl: int, seed: int, bench_lock: bool = False) -> Ok:
        """``bench_lock``: the judge allows this warm-up's GPU benchmarking to wait for other processes' timings
        (benchlock; it holds no exclusive lock of its own now, which the wait would deadlock on)."""
        bl = self.bench_lock
        waited0 = bl.waited_s if bl is not None else 0.0
        inputs = self.make_inputs(self.task, wl, seed, self.device)
        if bl is not None:
            bl.armed = bench_lock
        try:
            out = self.call(self.fn, inputs, warm=True)
        finally:
            if bl is not None:
                bl.armed = False
        del out, inputs
        self.fail_if_tampered()
        if bl is None:
            return Ok(kind=Kind.ok)
        return Ok(kind=Kind.ok, waited_s=bl.waited_s - waited0)

    def do_prepare(self, wl: int, seed: int, fresh: bool = False) -> Ok:
        if fresh:  # a reused champion worker: the last evaluation's sets go before this one's are made
            self.sets.pop(wl, None)
            self.uses.pop(wl, None)
        self.sets.setdefault(wl, []).append(self.make_inputs(self.task, wl, seed, self.device))
        return Ok(kind=Kind.ok)

    def do_check(self, wl: int, seed: int, keep: bool, held: bool = True) -> Outputs:
        inputs = self.make_inputs(self.task, wl, seed, self.device)
        pristine = self.snapshot(inputs)
        self._poison(wl)
        outs = self._normalize(self.call(self.fn, inputs), wl)
        self._validate(wl, outs, inputs, self.held.get(wl, []) if held else [])
        if not self._inputs_unchanged(inputs, pristine):
            raise CandidateFailure("rejected_hack", f"workload {wl}: candidate mutated its inputs")
        msg = self.emit(Tag.check, wl, outs)
        self.held.setdefault(wl, []).extend(outs)
        if keep:
            self.sets.setdefault(wl, []).append(inputs)
        return msg

    def do_reuse(self, wl: int) -> Outputs:
        # Same buffers, new contents: a result cached by pointer or call count goes stale here.
        # Written through the storage: inputs may be expanded views (no element-wise copy into them).
        sets = self.sets[wl]
        saved = self.snapshot(sets[0])
        self.refill(sets[0], sets[1])
        self._poison(wl)
        outs = self._normalize(self.call(self.fn, sets[0]), wl)
        self._validate(wl, outs, sets[0], [])
        msg = self.emit(Tag.reuse, wl, outs)
        self.refill(sets[0], saved)
        self.held.pop(wl, None)  # correctness is over for this workload: its outputs may be freed
        return msg

    def do_stage(self, wl: int, seed: int) -> Ok:
        """Fresh inputs for the next burst's checked call, generated before the burst starts. The last set goes
        first: drawn while it was still held, two staged sets were alive at once, one input set more than the
        memory plan counts (L2/024 on the H100: 12 GB more, and its baseline ran out of memory while timed). No
        candidate code runs here, so the memory in use during a burst is the same, checked or not."""
        self.staged.pop(wl, None)
        self.fresh.discard(wl)
        self.staged[wl] = self.make_inputs(self.task, wl, seed, self.device)
        self.fresh.add(wl)
        return Ok(kind=Kind.ok)

    def _rotatable(self, wl: int) -> list[tuple[str, str, str | None] | None]:
        """Which inputs get new content before every timed use, and how they are drawn (name, dtype, description,
        as ``make_inputs`` passes them): plain random tensors whose values are independent draws; masks, tables,
        custom and file inputs keep their content (the checked calls still see fresh sets of those)."""
        torch = self.torch
        out: list[tuple[str, str, str | None] | None] = []
        w = self.task.workloads[wl]
        for (name, spec), x in zip(self.task.definition.inputs.items(), self.sets[wl][0], strict=True):
            ok = isinstance(x, torch.Tensor) and w.inputs[name].type == "random" and x.numel() > 1
            ok = ok and x.is_contiguous() and "mask" not in name
            if ok and self.role_of is not None:
                role = self.role_of(name, tuple(x.shape), getattr(spec, "description", None))
                ok = role.value in ("plain", "weight_matrix", "norm_weight", "norm_bias", "positive", "decay")
            out.append((name, spec.dtype, getattr(spec, "description", None)) if ok else None)
        return out

    def _versions(self, inputs: list[Any]) -> list[tuple[Any, int]]:
        """(tensor, its version counter now) for each tensor input."""
        return [(x, x._version) for x in inputs if isinstance(x, self.torch.Tensor) and not x.is_inference()]

    def _version_step(self, versions: list[tuple[Any, int]], step: int) -> None:
        """Every input's version counter moved by the same step before every timed call, checked or not. The
        rewrites differ (a refresh's ``copy_`` moves the rotated tensors' counters by one and no other's; a checked
        call's refill copies storages, which moves none), and a red team told the checked call from the others by
        ``x._version`` alone: skipping the work when an input's version moved by one was crowned 126x on a GEMM.
        The step exceeds what either rewrite can move a counter by (views sharing one counter included)."""
        for x, v0 in versions:
            try:
                while x._version < v0 + step:
                    self.increment_version(x)
            except RuntimeError:  # a tensor without a version counter of its own (none of a plain input's kinds)
                continue

    @staticmethod
    def _seed() -> int:
        return int.from_bytes(os.urandom(8), "little") >> 2

    def _refresh(self, inputs: list[Any], rot: list[tuple[str, str, str | None] | None]) -> None:
        """New content in the same buffers: the plain random tensors drawn again from a seed of os.urandom, with
        the distribution that seed stands for, as a checked set is drawn; no row of a timed call's input equals
        one seen before, and no result cached on identity, version, sampled elements or any statistic of the
        values is right again."""
        seed = self._seed()
        gen = self.torch.Generator(device=self.device)
        gen.manual_seed(seed)
        dist = self.distribution_for(seed)
        for x, spec in zip(inputs, rot, strict=True):
            if spec is not None:
                name, dtype, desc = spec
                x.copy_(self.random_tensor(name, tuple(x.shape), dtype, gen, self.device, dist, desc))

    def _redraw(self, wl: int, inputs: list[Any]) -> None:
        """New content in the same buffers for a problem whose inputs all come from its own ``get_inputs``: a whole
        set drawn by it from a seed of os.urandom and copied in as a checked call's staged set is (``refill``: the
        same copies, so no counter, pointer or layout tells the two apart). Without it such a problem's timed
        calls repeat one content, and a result kept by content (the red team's c02) pays on all but the checked
        call. The judge asks for it where a draw is cheap and the memory plan counts the transient set
        (``Guard.fresh_inputs``, ``MemoryPlan.redraw``)."""
        new = self.make_inputs(self.task, wl, self._seed(), self.device)
        self.refill(inputs, new)
        del new

    def _fingerprint(self, inputs: list[Any], rot: list[Any]) -> list[tuple[int, int]]:
        """An exact, order-sensitive fingerprint of the inputs that keep their content between timed calls: the
        sum of their bit patterns and that sum weighted by position (int64, wrapping), a chunk at a time."""
        torch = self.torch
        ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
        out = []
        for x, spec in zip(inputs, rot, strict=True):
            if spec is not None or not isinstance(x, torch.Tensor) or x.element_size() not in ints:
                continue
            flat = x.reshape(-1)
            bits = flat.view(ints[x.element_size()]) if flat.dtype != torch.bool else flat.view(torch.uint8)
            s1 = s2 = 0
            step = 1 << 24
            for a in range(0, bits.numel(), step):
                chunk = bits[a : a + step].to(torch.int64)
                w = (torch.arange(a, a + chunk.numel(), device=chunk.device, dtype=torch.int64) * 40503) % 65521 + 1
                s1 += int(chunk.sum())
                s2 += int((chunk * w).sum())
            out.append((s1, s2))
        return out

    def do_time(
        self,
        wl: int,
        n: int,
        warm: bool = False,
        check: bool = False,
        warm_ms: float | None = None,
        check_at: int | None = None,
        fresh: bool = False,
    ) -> Timing:
        tcfg = self.job["timing"]
        if self.timer is None:
            self.timer = self.timer_mod.Timer(
                self.torch, self.device, int(tcfg["flush_bytes"]), int(tcfg.get("head_start_cycles", 200_000)),
                use_cupti=bool(tcfg.get("cupti", True)),
            )  # fmt: skip
            self.warnings += self.timer.notes
            self.integrity.watch("timer", self.timer, {"notes", "_session", "cupti_used", "method"})
        sets = self.sets[wl]
        rot = self._rotatable(wl)
        if warm:  # the judge times one workload after the other: one staged set at a time, as before
            for k in [k for k in self.staged if k != wl]:
                del self.staged[k]
                self.fresh.discard(k)
        if wl not in self.staged:
            self.staged[wl] = self.make_inputs(self.task, wl, self._seed(), self.device)
        if check and wl not in self.fresh:
            raise CandidateFailure("runtime_error", "internal: checked burst without staged inputs")
        staged = self.staged[wl] if check else None
        if check:
            self.fresh.discard(wl)
        # The checked call's place in the burst is the judge's secret (the last one when it names none).
        at = (n - 1 if check_at is None else int(check_at)) if check else None
        if at is not None and not 0 <= at < n:
            raise CandidateFailure("runtime_error", f"internal: checked call {at} outside a burst of {n}")
        last_set: list[Any] = []
        # what the inputs that keep their content hold now; the checked call's set is fingerprinted again after
        # its refill (outside the timed region, like the refill). ``fresh``: every call's set is rewritten whole
        # from a new draw of the problem's own inputs (``_redraw``), so nothing keeps its content and a mark
        # written into an input is gone by the next call.
        prints = None if fresh else [self._fingerprint(s, rot) for s in sets]

        def setup(k: int) -> list[Any]:
            i = self.uses.get(wl, 0)
            self.uses[wl] = i + 1
            inputs = sets[i % len(sets)]
            versions = self._versions(inputs)
            if staged is not None and k == at:
                self.refill(inputs, staged)
                last_set[:] = inputs
                if prints is not None:
                    prints[i % len(sets)] = self._fingerprint(inputs, rot)
            elif fresh:
                self._redraw(wl, inputs)
            else:
                self._refresh(inputs, rot)
            self._version_step(versions, len(inputs) + 1)  # more than either rewrite moves a counter by
            self._poison(wl)  # before every call, so that a checked one looks like any other
            # Every call starts on an idle device: what the set-up enqueued differs between a checked call (a copy)
            # and the others (a draw and a copy), and a kernel whose launches take the host longer than the work
            # queued ahead of them measured its checked calls 1.7-2.7x slower than the rest (a composed L1/058 on
            # the H100: 0.068 vs 0.025 ms), which the rule on checked calls reads as work skipped. Behind an idle
            # device every call gets the same head start (the flush and the timer's sleep) whatever came before.
            self._sync()
            return inputs

        try:
            if warm:
                # Warm-up, which also gives the judge the per-call time: at least 2 calls, warmup_ms long.
                samples, t_start = [], _perf_counter()
                while len(samples) < 2 or (_perf_counter() - t_start) * 1e3 < float(warm_ms or tcfg["warmup_ms"]):
                    samples.append(self.timer.single(setup, self.fn))
                    if len(samples) >= 1000:
                        break
                events, last = None, None
            else:
                samples, events, last = self.timer.burst(n, setup, self.fn, at)
                self._sync()
        except CandidateFailure:
            raise
        except BaseException as e:  # noqa: BLE001
            raise _classify(e) from None
        if self.timer.cupti_used:
            # CUPTI delivers its activity buffers on a thread of its own, which Python lists as a dummy
            # thread once a callback ran there: the harness's, not the candidate's (also after a fall-back to
            # CUDA events, which can follow a burst whose buffers that thread delivered).
            self.threads0 |= {t.ident for t in self.threading.enumerate() if t.name.startswith("Dummy-")}
        self.fail_if_tampered(full=False)
        for used in (*sets, last_set):  # (the burst's set-ups read them between calls: a hack is seen here, after)
            self._inputs_plain(used)
        self._no_strays()
        wrote = prints is not None and any(
            self._fingerprint(s, rot) != before for s, before in zip(sets, prints, strict=True)
        )
        if wrote:
            raise CandidateFailure(
                "rejected_hack", f"workload {wl}: candidate wrote into its inputs during timed calls"
            )
        if not check:
            self.fail_if_tampered()  # a checked burst's outputs get the full check in emit
        excess = None
        if warm and self.is_cuda:
            excess = self.timer.excess_ms(setup, self.fn)
            self.fail_if_tampered(full=False)
        out_msg = None
        if check:
            result, values = last
            outs = self._normalize(result, wl)
            self._validate(wl, outs, last_set, [])  # shapes, dtypes, layout and aliasing of the call's own outputs
            # the copy taken right after the call (later calls may have overwritten its outputs) gives the
            # values; the call's own outputs give the layout
            if values is None:
                out_msg = self.emit(Tag.timed, wl, outs)
            else:
                copied = self._normalize(values, wl)
                out_msg = self.emit(Tag.timed, wl, copied, like=outs)
                del copied
            del outs, result, values
        del last
        return Timing(kind=Kind.timing, wl=wl, method=self.timer.method, samples_ms=samples, events_ms=events,
                      excess_ms=excess, check=out_msg)  # fmt: skip


class StepProfile:
    """Wall seconds and calls of wrapped steps, written as JSON to ``path`` on ``flush``. In a worker
    (``KERNELARC_PROFILE_DIR``) after every command, and in the judge, by scripts/guard_cost.py --profile: where
    the guard's time per candidate goes; a diagnostic, never on in a search. A worker's steps are timed by
    wrappers set on the classes before the integrity snapshot, or on the harness instance (which the snapshot
    does not cover: nothing the candidate can use)."""

    def __init__(self, path: str):
        self.path = path
        self.spent: dict[str, list[float]] = {}

    def wrap(self, obj: Any, name: str, label: str) -> None:
        f = getattr(obj, name)
        spent = self.spent.setdefault(label, [0.0, 0])

        def timed(*a, **k):
            t = _perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[0] += _perf_counter() - t
                spent[1] += 1

        setattr(obj, name, timed)

    def flush(self) -> None:
        import json

        with contextlib.suppress(OSError), open(self.path, "w") as fh:
            json.dump({k: {"s": round(v[0], 6), "n": v[1]} for k, v in self.spent.items()}, fh)


def _profiler() -> StepProfile | None:
    where = os.environ.get("KERNELARC_PROFILE_DIR")
    if not where:
        return None
    from kernelarc.guard import timer

    prof = StepProfile(os.path.join(where, f"worker-{os.getpid()}.json"))
    for cls, name in ((timer._CuptiSession, "take"), (timer._CuptiSession, "_completed"), (timer.Timer, "_events"),
                      (timer.Timer, "single"), (timer.Timer, "excess_ms")):  # fmt: skip
        prof.wrap(cls, name, f"timer.{name}")
    return prof


def _profile_harness(prof: StepProfile, h: Harness) -> None:
    names = ["do_warmup", "do_check", "do_prepare", "do_reuse", "do_stage", "do_time", "make_inputs", "snapshot"]
    names += ["refill", "_refresh", "_redraw", "_poison", "_validate", "emit", "fail_if_tampered", "_no_strays"]
    names += ["_sync"]
    for name in names:
        prof.wrap(h, name, name)


def _die_with_parent(period_s: float = 1.0) -> None:
    """Kill this worker's process group once its parent is gone.

    Leading its own group keeps the worker out of the terminal's signals, so a search killed by
    SIGTERM or SIGKILL (a CI timeout, `timeout`, an OOM kill) would otherwise leave the worker and
    its nvcc running, holding the GPU and the caller's pipes. Started before any candidate code
    exists, so the harness's thread check counts it as its own.
    """
    import signal
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period_s)
        # The group only when this worker leads it (as pool.Worker.kill checks): had setpgid failed,
        # the group would be the caller's, with whatever else it runs.
        if os.getpgid(0) == os.getpid():
            os.killpg(os.getpid(), signal.SIGKILL)
        os._exit(1)

    threading.Thread(target=watch, name="kernelarc-parent-watch", daemon=True).start()


def main() -> None:
    """Entry point of a pre-started worker process: ``python -c ... FD DEVICE`` (pool._spawn).

    Started in its own session (pool: start_new_session), stdin closed, stdout/stderr on a log file
    the judge created: nothing a candidate prints reaches the judge. Talks to the judge over the
    socket FD only.
    """
    import socket

    fd, device = int(sys.argv[1]), sys.argv[2]
    _die_with_parent()
    chan = Channel(socket.socket(fileno=fd))
    harness: Harness | None = None
    try:
        import torch

        with contextlib.suppress(Exception):
            import triton  # noqa: F401 - imported ahead so candidates do not pay for it
        from kernelarc.guard import benchlock

        bench_lock = benchlock.install()  # before any candidate code
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
            torch.empty(1, device=device).fill_(1.0)
            torch.cuda.synchronize()
        mapped = None
        if len(sys.argv) > 4:  # the pool's output buffer: mapped and page-locked before the job, off its path
            from kernelarc.guard import buffers

            handle = ("file", sys.argv[3], int(sys.argv[4]))
            mapped = (handle, buffers.open_buffer(handle, page_lock=device.startswith("cuda")))
        chan.send_message(Ready(kind=Kind.ready, pid=os.getpid()))
        job = chan.recv_command()
        if job.pop("cmd") is not Cmd.job:
            return
        try:
            prof = _profiler()  # before the integrity snapshot (its class wrappers are the harness's own)
            harness = Harness(chan, job, mapped)
            harness.bench_lock = bench_lock
            if prof is not None:
                _profile_harness(prof, harness)
                harness.profile = prof
            harness.serve()
        except CandidateFailure as f:
            _send_fail(chan, harness, f)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            raise
        except BaseException as e:  # noqa: BLE001
            _send_fail(chan, harness, _classify(e))
        sys.stdout.flush()
        sys.stderr.flush()
        # Keep the shared output buffer mapped until the judge is done with it (it kills this process).
        with contextlib.suppress(Exception):
            chan.recv_frame(3600.0)
    except (EOFError, BrokenPipeError, ConnectionResetError, TimeoutError):
        pass
    finally:
        os._exit(0)


def _send_fail(chan: Channel, harness: Harness | None, f: CandidateFailure) -> None:
    status = f.status if f.status in {s.value for s in FailStatus} else "runtime_error"
    phases = harness.phases if harness is not None else {}
    warnings = harness.warnings[:64] if harness is not None else []
    with contextlib.suppress(Exception):
        chan.send_message(Fail(kind=Kind.fail, status=FailStatus(status), error=_trim(f.message, 8000),
                               phases=phases, warnings=warnings))  # fmt: skip
