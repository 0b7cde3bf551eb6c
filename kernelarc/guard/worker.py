"""Isolated, single-use guard worker: runs one untrusted candidate and reports over a pipe.

The worker is started ahead of time (torch imported, device initialised), takes exactly
one job, and exits. It never sees reference outputs: it sends the candidate's outputs to
the judge over the pipe (shared memory / CUDA IPC) and the judge decides. stdout and
stderr are redirected to a file, so nothing a candidate prints can reach the judge as a
result.
"""

from __future__ import annotations

import contextlib
import os
import random
import sys
import tempfile
import time
import traceback
from typing import Any

# Captured before any candidate code exists in this process; the harness only calls these.
_perf_counter = time.perf_counter


# Helper threads that torch itself starts (Inductor's compile machinery, its progress bar):
# candidates cannot import threading (static check), so these names come from torch.
TORCH_THREADS = {"InductorSubproc", "tqdm_monitor", "subproc_worker_timer"}


class CandidateFailure(Exception):
    def __init__(self, status: str, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


def _trim(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2 :]


def _classify(exc: BaseException) -> CandidateFailure:
    import torch

    name = type(exc).__name__
    msg = f"{name}: {exc}"
    tb = _trim("".join(traceback.format_exception(exc))[-3000:])
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return CandidateFailure("runtime_error", f"out of memory: {_trim(str(exc), 500)}")
    mod = type(exc).__module__ or ""
    if (
        "Compil" in name
        or "triton.compiler" in mod
        or name in ("CompileTimeAssertionFailure", "UnsupportedLanguageConstruct")
    ):
        return CandidateFailure("compile_error", _trim(msg + "\n" + tb))
    return CandidateFailure("runtime_error", _trim(msg + "\n" + tb))


def _integrity_snapshot() -> dict[str, Any]:
    import torch

    snap = {
        "time.perf_counter": time.perf_counter,
        "time.time": time.time,
        "time.monotonic": time.monotonic,
        "torch.Tensor": torch.Tensor,
        "torch.empty": torch.empty,
        "torch.equal": torch.equal,
        "torch.allclose": torch.allclose,
    }
    if torch.cuda.is_available():
        snap.update(
            {
                "torch.cuda.Event": torch.cuda.Event,
                "torch.cuda.Event.elapsed_time": torch.cuda.Event.elapsed_time,
                "torch.cuda.Event.record": torch.cuda.Event.record,
                "torch.cuda.synchronize": torch.cuda.synchronize,
                "torch.cuda.current_stream": torch.cuda.current_stream,
            }
        )
    try:
        import triton.testing

        snap["triton.testing.do_bench"] = triton.testing.do_bench
    except Exception:  # noqa: BLE001 - triton is optional for pytorch-only workers
        pass
    return snap


def _check_integrity(snap: dict[str, Any]) -> None:
    import torch

    current = _integrity_snapshot()
    for key, obj in snap.items():
        if current.get(key) is not obj:
            raise CandidateFailure("rejected_hack", f"harness function {key} was replaced (timer/harness patching)")
    del torch


def _children() -> list[int]:
    me = str(os.getpid())
    kids = []
    try:
        for pid in os.listdir("/proc"):
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
    def __init__(self, conn, job: dict[str, Any]):
        import threading

        import torch

        from kernelarc.tasks.inputs import load_module, make_inputs, refill, snapshot, torch_dtype
        from kernelarc.tasks.loader import load_task

        self.torch = torch
        self.conn = conn
        self.job = job
        self.device = torch.device(job["device"])
        self.is_cuda = self.device.type == "cuda"
        self.task = load_task(job["task_path"], workload_file=job["workload_file"])
        self.make_inputs = make_inputs
        self.refill, self.snapshot = refill, snapshot
        self.load_module = load_module
        self.torch_dtype = torch_dtype
        self.out_specs = list(self.task.definition.outputs.items())
        self.warnings: list[str] = []
        self.phases: dict[str, float] = {}
        self.threads0 = {t.ident for t in threading.enumerate()}
        self.threading = threading
        self.rng = random.Random(job["rng_seed"])

    # -- messaging ---------------------------------------------------------------------
    def send(self, kind: str, payload: Any) -> None:
        self.conn.send((kind, payload))

    def recv(self) -> tuple[str, Any]:
        return self.conn.recv()

    def acquire_gpu(self) -> None:
        """Wait until the judge grants this worker the device (one candidate measures at a time)."""
        self.send("want_gpu", None)
        kind, _ = self.recv()
        assert kind == "go", kind

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

    def _normalize(self, result: Any) -> list[Any]:
        n = len(self.out_specs)
        if isinstance(result, dict):
            missing = [k for k, _ in self.out_specs if k not in result]
            if missing:
                raise CandidateFailure("incorrect", f"returned dict lacks outputs {missing}")
            return [result[k] for k, _ in self.out_specs]
        if isinstance(result, tuple | list):
            if len(result) != n:
                raise CandidateFailure("incorrect", f"returned {len(result)} outputs, expected {n}")
            return list(result)
        if n != 1:
            raise CandidateFailure("incorrect", f"returned 1 output, expected {n}")
        return [result]

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
                if not isinstance(o, int | float | bool):
                    raise CandidateFailure(
                        "incorrect", f"output {name}: expected a Python scalar, got {type(o).__name__}"
                    )
                continue
            if type(o) is not torch.Tensor:
                raise CandidateFailure(
                    "rejected_hack",
                    f"output {name}: {type(o).__module__}.{type(o).__name__} is not a plain torch.Tensor",
                )
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
            for a, b in spans:
                if lo < b and a < hi:
                    raise CandidateFailure("incorrect", f"output {name} overlaps another output")
            spans.append((lo, hi))

    def _inputs_unchanged(self, inputs: list[Any], pristine: list[Any]) -> bool:
        torch = self.torch
        for x, p in zip(inputs, pristine, strict=True):
            if isinstance(x, torch.Tensor):
                if x.shape != p.shape or x.dtype != p.dtype:
                    return False
                if not torch.equal(x.contiguous().view(torch.uint8), p.contiguous().view(torch.uint8)):
                    return False
        return True

    def call(self, fn, inputs: list[Any]) -> Any:
        try:
            result = fn(*inputs)
            self._sync()
        except CandidateFailure:
            raise
        except BaseException as e:  # noqa: BLE001 - any candidate failure is a verdict
            if isinstance(e, KeyboardInterrupt | SystemExit):
                raise CandidateFailure("rejected_hack", f"candidate raised {type(e).__name__}") from None
            raise _classify(e) from None
        extra = [t for t in self.threading.enumerate() if t.ident not in self.threads0 and t.name not in TORCH_THREADS]
        if extra:
            names = ", ".join(t.name for t in extra)
            raise CandidateFailure("rejected_hack", f"candidate started threads that outlive the call: {names}")
        if _children():
            raise CandidateFailure("rejected_hack", "candidate started processes that outlive the call")
        return result

    def check_outputs(self, tag: str, wl: int, seed_idx: int, outs: list[Any], extra: dict | None = None) -> bool:
        torch = self.torch
        payload_outs = [o.detach() if isinstance(o, torch.Tensor) else o for o in outs]
        self.send("outputs", {"tag": tag, "wl": wl, "seed_idx": seed_idx, "outputs": payload_outs, **(extra or {})})
        # Sharing tensors may start multiprocessing's own fd-server thread: that one is ours.
        self.threads0 |= {t.ident for t in self.threading.enumerate()}
        kind, reply = self.recv()
        assert kind == "ack", kind
        return bool(reply["ok"])

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

    # -- phases --------------------------------------------------------------------------
    def run(self) -> None:
        torch = self.torch
        job = self.job
        snap = _integrity_snapshot()
        t0 = _perf_counter()
        try:
            cand = self.load_module(job["source"], "candidate")
        except SyntaxError as e:
            raise CandidateFailure("compile_error", f"SyntaxError line {e.lineno}: {e.msg}") from None
        except BaseException as e:  # noqa: BLE001
            f = _classify(e)
            raise CandidateFailure("compile_error", f"import failed: {f.message}") from None
        fn = getattr(cand, "run", None)
        if not callable(fn):
            raise CandidateFailure("compile_error", "module defines no callable run()")
        _check_integrity(snap)
        self.phases["import"] = _perf_counter() - t0
        self._note_cutlass_builds(cand)
        self.send("imported", None)  # any build is done: the judge's plain time limit starts now

        seeds: list[int] = job["seeds"]
        wls: list[int] = job["workloads"]
        sets: dict[int, list[list[Any]]] = {}
        held: list[Any] = []
        champion_fn = None
        if job["timing"]["enabled"] and job.get("champion_source"):
            champion_fn = self.load_module(job["champion_source"], "champion").run
        # Warm-up outside the device lock: JIT compilation (CPU-bound) overlaps other candidates'
        # measurements; everything that is checked or timed happens while this worker holds the GPU.
        # A CUTLASS candidate was built at import and has nothing to compile here, so it warms up
        # under the lock too: a kernel of its that hangs or runs long then only delays the others,
        # and never shares the GPU with their timing (the judge kills it at the plain limit).
        timed = job["timing"]["enabled"]
        gpu_first = timed and job.get("language") == "cutlass"
        if gpu_first:
            self.acquire_gpu()
        t0 = _perf_counter()
        for wl in wls:
            warm_inputs = self.make_inputs(self.task, wl, seeds[0], self.device)
            for f in (fn, champion_fn) if champion_fn else (fn,):
                out = self.call(f, warm_inputs)
                del out
            del warm_inputs
        _check_integrity(snap)
        self.phases["compile"] = _perf_counter() - t0
        if timed and not gpu_first:
            self.acquire_gpu()
        t0 = _perf_counter()
        for wl in wls:
            sets[wl] = []
            for j, seed in enumerate(seeds):
                inputs = self.make_inputs(self.task, wl, seed, self.device)
                pristine = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
                self._poison(wl)
                outs = self._normalize(self.call(fn, inputs))
                self._validate(wl, outs, inputs, held)
                if not self._inputs_unchanged(inputs, pristine):
                    raise CandidateFailure("rejected_hack", f"workload {wl}: candidate mutated its inputs")
                _check_integrity(snap)
                if not self.check_outputs("check", wl, j, outs):
                    return  # the judge has its verdict (incorrect)
                held.extend(outs)
                sets[wl].append(inputs)
                del pristine
            if len(seeds) >= 2:
                # Same buffers, new contents: a result cached by pointer or call count goes stale here.
                # Written through the storage: inputs may be expanded views (no element-wise copy into them).
                saved = self.snapshot(sets[wl][0])
                self.refill(sets[wl][0], sets[wl][1])
                self._poison(wl)
                outs = self._normalize(self.call(fn, sets[wl][0]))
                self._validate(wl, outs, sets[wl][0], [])
                if not self.check_outputs("reuse", wl, 1, outs):
                    return
                self.refill(sets[wl][0], saved)
                del outs, saved
        held.clear()
        self.phases["correctness"] = _perf_counter() - t0

        if not job["timing"]["enabled"]:
            self.send("done", {"warnings": self.warnings, "phases": self.phases})
            return
        t0 = _perf_counter()
        for wl in wls:
            self.time_workload(fn, champion_fn, wl, sets[wl], snap)
        self.phases["timing"] = _perf_counter() - t0
        _check_integrity(snap)
        self.send("done", {"warnings": self.warnings, "phases": self.phases})

    def _timer(self):
        torch = self.torch
        tcfg = self.job["timing"]
        if self.is_cuda:
            flush = torch.empty(int(tcfg["flush_bytes"]), dtype=torch.uint8, device=self.device)

            sleep = getattr(torch.cuda, "_sleep", None)
            head_start = int(tcfg.get("head_start_cycles", 200_000))

            def timed(fn, inputs):
                flush.zero_()
                if sleep is not None and head_start > 0:
                    # Keep the GPU busy while the host enqueues the call, so that host-side launch cost
                    # of short kernels is not timed as device time.
                    sleep(head_start)
                s = torch.cuda.Event(enable_timing=True)
                e = torch.cuda.Event(enable_timing=True)
                s.record()
                out = fn(*inputs)
                e.record()
                return out, (s, e)

            def resolve(tok) -> float:
                return tok[0].elapsed_time(tok[1])

        else:
            flush = torch.empty(int(min(tcfg["flush_bytes"], 1 << 24)), dtype=torch.uint8)

            def timed(fn, inputs):
                flush.zero_()
                t = _perf_counter()
                out = fn(*inputs)
                return out, (_perf_counter() - t) * 1e3

            def resolve(tok) -> float:
                return tok

        return timed, resolve

    def time_workload(self, fn, champion_fn, wl: int, sets: list[list[Any]], snap) -> None:
        tcfg = self.job["timing"]
        timed, resolve = self._timer()
        R = len(sets)
        try:
            # Warm-up, which also estimates the per-call time.
            t_start = _perf_counter()
            n_warm = 0
            while n_warm < 2 or (_perf_counter() - t_start) * 1e3 < tcfg["warmup_ms"]:
                for f in (fn, champion_fn) if champion_fn else (fn,):
                    out, _ = timed(f, sets[n_warm % R])
                    del out
                n_warm += 1
                self._sync()
                if n_warm >= 1000:
                    break
            est = max((_perf_counter() - t_start) * 1e3 / n_warm, 1e-3)
            n = int(min(max(tcfg["target_ms"] / est, tcfg["min_iters"]), tcfg["max_iters"]))
            keep = set(self.rng.sample(range(n), k=min(2, n))) | {n - 1}
            kept: list[tuple[int, Any]] = []
            toks, champ_toks = [], []
            for k in range(n):
                out, tok = timed(fn, sets[k % R])
                toks.append(tok)
                if k in keep:
                    kept.append((k % R, out))
                del out
                if champion_fn is not None:
                    cout, ctok = timed(champion_fn, sets[k % R])
                    champ_toks.append(ctok)
                    del cout
            self._sync()
            samples = [resolve(t) for t in toks]
            champ_samples = [resolve(t) for t in champ_toks] if champion_fn else None
            # Work still running after the call returned (side streams, host threads) shows up as
            # device-synchronised wall time far above the event time of the same call.
            excess = []
            for k in range(3 if self.is_cuda else 0):
                self._sync()
                t = _perf_counter()
                out, tok = timed(fn, sets[k % R])
                self.torch.cuda.synchronize()
                wall = (_perf_counter() - t) * 1e3
                excess.append(wall - resolve(tok))
                del out
        except CandidateFailure:
            raise
        except BaseException as e:  # noqa: BLE001
            raise _classify(e) from None
        _check_integrity(snap)
        median = sorted(samples)[len(samples) // 2]
        ex = sorted(excess)[len(excess) // 2] if excess else 0.0
        # Only a large, consistent excess counts: other workers' checks share the GPU and add delay.
        if excess and min(excess) > max(20.0, 10 * median):
            raise CandidateFailure(
                "rejected_hack",
                f"workload {wl}: {ex:.2f} ms of device work outlives the timed region "
                f"(median event time {median:.3f} ms): side stream or deferred work",
            )
        for set_idx, outs in kept:
            outs = self._normalize(outs)
            if not self.check_outputs("timed", wl, set_idx, outs):
                raise CandidateFailure("rejected_hack", f"workload {wl}: an output produced while timed is wrong")
        self.send("timing", {"wl": wl, "samples_ms": samples, "champion_samples_ms": champ_samples, "warmup": n_warm})


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


def worker_main(conn, device: str, log_dir: str | None = None) -> None:
    """Entry point of a pre-started worker process."""
    # Its own process group, so that killing the worker (timeout, hang, retirement) also kills what
    # it started: a CUTLASS candidate's nvcc build, Triton's ptxas (pool.Worker.kill).
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _die_with_parent()
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    # torch.compile compiles in this process instead of a subprocess pool (no stray children).
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # Redirect stdout/stderr before any candidate code exists: results travel only on `conn`.
    fd, log_path = tempfile.mkstemp(prefix="kernelarc-worker-", suffix=".log", dir=log_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        import torch

        try:
            import triton  # noqa: F401 - imported ahead so candidates do not pay for it
        except Exception:  # noqa: BLE001
            pass
        if device.startswith("cuda"):
            torch.cuda.set_device(torch.device(device))
            torch.empty(1, device=device).fill_(1.0)
            torch.cuda.synchronize()
        conn.send(("ready", {"pid": os.getpid(), "log": log_path}))
        kind, job = conn.recv()
        if kind != "job":
            return
        harness = Harness(conn, job)
        try:
            harness.run()
        except CandidateFailure as f:
            conn.send(("fail", {"status": f.status, "error": f.message, "phases": harness.phases,
                                "warnings": harness.warnings}))  # fmt: skip
        except BaseException as e:  # noqa: BLE001
            f = _classify(e)
            conn.send(("fail", {"status": f.status, "error": f.message, "phases": harness.phases,
                                "warnings": harness.warnings}))  # fmt: skip
        sys.stdout.flush()
        sys.stderr.flush()
        conn.send(("stdout", {"log": log_path}))
        # Keep shared output tensors alive until the judge is done with them.
        try:
            conn.recv()
        except EOFError:
            pass
    except (EOFError, BrokenPipeError):
        pass
    finally:
        os._exit(0)
