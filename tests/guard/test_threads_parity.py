"""Threads, counted as NVIDIA's harness counts them (issues 13 and 15).

NVIDIA's eval driver takes ``threading.active_count()`` once per workload, right after its first call
of the solution (round 0 of the correctness rounds, where JIT compilers may start their threads), and
again after the 9 further correctness rounds and the timed calls; any increase is REWARD_HACK ("Thread
injection detected"), whatever the threads' names. On the H200 two exported composed champions
failed so: their rest ran under torch.compile, whose first Triton compile creates Inductor's compile
pool (a sidecar process and a reader thread) and submits a readiness job; the answer arrives seconds
later and starts the pool's timer thread (``subproc_worker_timer``) during the counted calls. The guard
exempted torch's thread names and its workers compile in-process (TORCHINDUCTOR_COMPILE_THREADS=1), so
it never saw it. Now torch's names are exempt only until the first call ends, and exported solutions
that compile set ``compile_threads = 1`` as the guard's workers run.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (shared_dirs, cpu_guard), also in a subprocess
from cpu_guard import rmsnorm_cpu_guard  # noqa: E402
from shared_dirs import HARNESS_SRC, from_harness  # noqa: E402

from kernelarc.exporting import export_solution
from kernelarc.models import Candidate, Status
from kernelarc.tasks.inputs import make_inputs, torch_dtype

GRAPH_TESTS = Path(__file__).resolve().parents[1] / "graph"

RMS = """
def _rms(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
"""
# torch's own machinery, the very thread NVIDIA's harness counted on the H200 (Inductor's compile-pool
# timer), started on the second call: past NVIDIA's round 0, so its count rises
TIMER_LATE = (
    "import torch\nfrom torch._inductor.compile_worker.timer import Timer\n"
    + RMS
    + """
_CALLS = [0]
_TIMERS = []


def run(x, weight):
    _CALLS[0] += 1
    if _CALLS[0] == 2:
        t = Timer(3600, lambda: None)
        t.record_call()
        _TIMERS.append(t)
    return _rms(x, weight)
"""
)
# the same thread started during the first call: inside NVIDIA's round 0, so part of its baseline
TIMER_AT_WARMUP = TIMER_LATE.replace("_CALLS[0] == 2", "_CALLS[0] == 1")
# what Inductor does at each compile when tqdm is installed (the GPU image): a disabled progress bar, whose
# first instance starts tqdm's monitor thread; here on the second call, as a shape dispatch's compiled part
# compiles only when its shape first comes (rejected on the H200 as thread injection before the worker
# started that thread itself)
TQDM_LATE = (
    "import torch\nfrom tqdm import tqdm\n"
    + RMS
    + """
_CALLS = [0]


def run(x, weight):
    _CALLS[0] += 1
    if _CALLS[0] == 2:
        tqdm(total=1, disable=True)
    return _rms(x, weight)
"""
)
COMPILED = (
    "import torch\n" + RMS + "\n\n_fn = torch.compile(_rms)\n\n\ndef run(x, weight):\n    return _fn(x, weight)\n"
)


@pytest.fixture(scope="module")
def guard():
    with rmsnorm_cpu_guard(prestart=1) as g:
        yield g


def test_a_torch_thread_started_after_the_first_call_is_thread_injection(guard):
    # trusted: a candidate may not import torch's private modules (the static checks); the thread rules still apply
    v = guard.evaluate(Candidate(source=TIMER_LATE, language="pytorch"), timeout_s=20, trusted=True).verdict
    assert v.status is Status.rejected_hack, (v.status, v.errors)
    text = " ".join(v.errors)
    assert "thread injection" in text and "subproc_worker_timer" in text, text


def test_a_torch_thread_started_in_the_first_call_is_in_the_baseline(guard):
    v = guard.evaluate(Candidate(source=TIMER_AT_WARMUP, language="pytorch"), timeout_s=20, trusted=True).verdict
    assert v.correct, (v.status, v.errors)


def test_tqdm_monitor_of_a_late_compile_is_not_the_candidates_thread(guard):
    pytest.importorskip("tqdm")
    # trusted: a candidate may not import tqdm itself (the import allow-list); Inductor's compile starts it the same way
    v = guard.evaluate(Candidate(source=TQDM_LATE, language="pytorch"), timeout_s=20, trusted=True).verdict
    assert v.correct, (v.status, v.errors)


def test_an_honest_torch_compile_kernel_passes(guard):
    v = guard.evaluate(Candidate(source=COMPILED, language="pytorch"), timeout_s=240).verdict
    assert v.correct, (v.status, v.errors)


# -- NVIDIA's own check around an exported solution ------------------------------------------------


@pytest.fixture(scope="module")
def nvidia():
    """``check_thread_injection`` and the timed-input allocator, from the vendored harness."""
    (allocator,) = from_harness("sol_execbench.core.bench.io", "ShiftingMemoryPoolAllocator")
    check, detected = from_harness(
        "sol_execbench.core.bench.reward_hack", "check_thread_injection", "RewardHackDetected"
    )
    return check, detected, allocator


def _composed_task(root: Path):
    spec = importlib.util.spec_from_file_location("_graph_problems", GRAPH_TESTS / "_problems.py")
    problems = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(problems)
    return problems.make_task(
        root, "p_mlp", problems.ADD_RMS_MLP,
        {"x": (["T", "H"], "bfloat16"), "res": (["T", "H"], "bfloat16"), "w": (["H"], "bfloat16"),
         "wg": (["I", "H"], "bfloat16"), "wu": (["I", "H"], "bfloat16")},
        {"h": (["T", "I"], "bfloat16"), "s": (["T", "H"], "bfloat16")},
        [{"T": 5, "H": 32, "I": 48}, {"T": 9, "H": 32, "I": 48}],
    )  # fmt: skip


def _export_composed(tmp_path: Path):
    """A composed candidate (fused add + RMSNorm on its Triton family, the rest under torch.compile),
    exported destination-passing as NVIDIA's harness runs it."""
    from kernelarc.families import families_for

    task = _composed_task(tmp_path / "task")
    fam = next(f for f in families_for(task) if f.name.endswith("fused_add_rmsnorm.rowblock"))
    src = fam.render(fam.check_point({"rest": "inductor"}))
    assert "torch.compile(" in src
    names_in, names_out = list(task.definition.inputs), list(task.definition.outputs)
    out = tmp_path / "sol"
    export_solution(Candidate(source=src, language="triton"), task.name, out, "sol-execbench", ["LOCAL"],
                    input_names=names_in, output_names=names_out)  # fmt: skip
    return task, out


def nvidia_protocol(sol_dir: str, task_dir: str, device: str) -> list[str]:
    """The exported solution's ``run``, every workload as NVIDIA's eval driver runs it: round 0, the
    thread count, rounds 1-9 on fresh inputs, then timed calls on its shifted-pointer inputs
    (``ShiftingMemoryPoolAllocator``), then ``check_thread_injection``, which raises on an increase.
    Returns the names of the threads alive at the end. Importable from a subprocess (the GPU test)."""
    sys.path.insert(0, str(HARNESS_SRC))
    from sol_execbench.core.bench.io import ShiftingMemoryPoolAllocator
    from sol_execbench.core.bench.reward_hack import check_thread_injection

    from kernelarc.tasks.loader import load_task

    task = load_task(task_dir)
    sys.path.insert(0, sol_dir)
    try:
        import main
    finally:
        sys.path.remove(sol_dir)
        sys.path.remove(str(HARNESS_SRC))

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    for wl in range(len(task.workloads)):
        shapes = [(task.shape(n, wl), torch_dtype(o.dtype)) for n, o in task.definition.outputs.items()]

        def outputs(shapes=shapes):
            return [torch.empty(s, dtype=d, device=device) for s, d in shapes]

        main.run(*make_inputs(task, wl, 0, device), *outputs())
        sync()
        before = threading.active_count()
        for r in range(1, 10):
            main.run(*make_inputs(task, wl, r, device), *outputs())
        timed = 20
        alloc = ShiftingMemoryPoolAllocator(make_inputs(task, wl, 11, device), outputs(), timed)
        for _ in range(timed):
            main.run(*alloc.get_unique_args())
        sync()
        check_thread_injection(before, threading.active_count())
    return sorted(t.name for t in threading.enumerate())


def test_nvidia_check_passes_the_exported_composed_solution(tmp_path, nvidia):
    task, out = _export_composed(tmp_path)
    kernel = (out / "kernelarc_kernel.py").read_text()
    assert kernel.count("compile_threads = 1") == 1
    try:
        alive = nvidia_protocol(str(out), str(tmp_path / "task" / task.name), "cpu")
        from torch._inductor.async_compile import AsyncCompile

        # what Inductor's Triton path asks at each compile on the GPU: with one compile thread, no pool
        assert torch._inductor.config.compile_threads == 1 and not AsyncCompile.use_process_pool()
        assert "InductorSubproc" not in alive and "subproc_worker_timer" not in alive, alive
    finally:
        for name in ("main", "kernelarc_kernel"):
            sys.modules.pop(name, None)


@pytest.mark.gpu
def test_nvidia_check_passes_the_exported_composed_solution_on_cuda(tmp_path, nvidia):
    """The same on the GPU (real Triton compiles, where Inductor's pool starts by default), in a fresh
    process as NVIDIA's harness runs a solution, with a fresh Inductor cache so that it really compiles."""
    task, out = _export_composed(tmp_path)
    script = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('parity', {__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"print('PASSED', m.nvidia_protocol({str(out)!r}, {str(tmp_path / 'task' / task.name)!r}, 'cuda'))\n"
    )
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)  # the harness's environment: torch's default
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0 and "PASSED" in r.stdout, (r.stdout, r.stderr[-3000:])


POOL_SCRIPT = """
import sys, threading, time
sys.path.insert(0, {harness!r})
from sol_execbench.core.bench.reward_hack import RewardHackDetected, check_thread_injection
import torch._inductor.config as config
from torch._inductor.async_compile import AsyncCompile

config.compile_threads = {threads}
AsyncCompile.use_process_pool()  # what Inductor's first Triton compile does on the GPU (round 0)
before = threading.active_count()
deadline = time.monotonic() + 60
while time.monotonic() < deadline and threading.active_count() <= before:
    time.sleep(0.2)  # NVIDIA's rounds 1-9 and timed calls
try:
    check_thread_injection(before, threading.active_count())
    print("PASSED", sorted(t.name for t in threading.enumerate()))
except RewardHackDetected as e:
    print("REWARD_HACK", e, sorted(t.name for t in threading.enumerate()))
"""


def test_nvidia_flags_inductors_compile_pool_and_one_compile_thread_avoids_it(nvidia):
    """The mechanism behind the H200 verdicts, on the CPU: the pool's timer thread appears after round 0."""
    scripts = {
        "REWARD_HACK": POOL_SCRIPT.format(harness=str(HARNESS_SRC), threads=2),
        "PASSED": POOL_SCRIPT.format(harness=str(HARNESS_SRC), threads=1).replace("+ 60", "+ 5"),
    }
    procs = {  # side by side: each waits seconds for a thread
        want: subprocess.Popen([sys.executable, "-c", src], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for want, src in scripts.items()
    }
    for want, p in procs.items():
        out, err = p.communicate(timeout=120)
        assert out.startswith(want), (want, out, err[-2000:])
        if want == "REWARD_HACK":
            assert "subproc_worker_timer" in out, out


CUDA_SCRIPT = """
import sys, threading, time
sys.path.insert(0, {harness!r})
from sol_execbench.core.bench.reward_hack import RewardHackDetected, check_thread_injection
import torch
import torch._inductor.config as config

if {threads} is not None:
    config.compile_threads = {threads}
fn = torch.compile(lambda x, w: torch.nn.functional.silu(x) * w + x.sum(-1, keepdim=True), mode={mode!r})
x, w = torch.randn(512, 1024, device="cuda"), torch.randn(1024, device="cuda")
fn(x, w)  # NVIDIA's round 0
torch.cuda.synchronize()
before = threading.active_count()
deadline = time.monotonic() + 20
while time.monotonic() < deadline:  # its rounds 1-9 and timed calls
    fn(torch.randn_like(x), w)
    torch.cuda.synchronize()
    time.sleep(0.01)
try:
    check_thread_injection(before, threading.active_count())
    print("PASSED", sorted(t.name for t in threading.enumerate()))
except RewardHackDetected as e:
    print("REWARD_HACK", e, sorted(t.name for t in threading.enumerate()))
"""


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("threads", "mode"),
    [(None, "default"), (1, "default"), (1, "max-autotune"), (1, "reduce-overhead")],
    ids=["torch_default", "one_compile_thread", "one_compile_thread_max_autotune", "one_compile_thread_cudagraphs"],
)
def test_the_h200_verdict_reproduced_and_avoided_on_cuda(tmp_path, nvidia, threads, mode):
    """torch.compile with torch's default compile threads, as NVIDIA's harness runs it: REWARD_HACK (the
    pool's timer thread starts after round 0); with one compile thread, as exports set it: PASSED, in
    the modes the search's baselines and composed rests use too (autotuning, CUDA-graph trees)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("TORCHINDUCTOR_COMPILE_THREADS", None)
    script = CUDA_SCRIPT.format(harness=str(HARNESS_SRC), threads=threads, mode=mode)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    want = "PASSED" if threads == 1 else "REWARD_HACK"
    assert r.stdout.startswith(want), (r.stdout, r.stderr[-3000:])
