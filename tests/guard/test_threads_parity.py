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
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kernelarc.exporting import export_solution
from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.models import Candidate, Status
from kernelarc.tasks import load_builtin
from kernelarc.tasks.inputs import make_inputs, torch_dtype

HARNESS_SRC = Path(__file__).resolve().parents[3] / "shared" / "sol-execbench-harness" / "src"
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
COMPILED = (
    "import torch\n" + RMS + "\n\n_fn = torch.compile(_rms)\n\n\ndef run(x, weight):\n    return _fn(x, weight)\n"
)


@pytest.fixture(scope="module")
def guard():
    task = load_builtin("rmsnorm", cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=20, target_ms=5, min_iters=3, max_iters=20, prestart=1))
    ref = g.evaluate(reference_candidate(task), trusted=True)
    assert ref.verdict.status is Status.champion
    g.set_baselines(ref, None)
    yield g
    g.close()


def test_a_torch_thread_started_after_the_first_call_is_thread_injection(guard):
    v = guard.evaluate(Candidate(source=TIMER_LATE, language="pytorch"), timeout_s=20).verdict
    assert v.status is Status.rejected_hack, (v.status, v.errors)
    text = " ".join(v.errors)
    assert "thread injection" in text and "subproc_worker_timer" in text, text


def test_a_torch_thread_started_in_the_first_call_is_in_the_baseline(guard):
    v = guard.evaluate(Candidate(source=TIMER_AT_WARMUP, language="pytorch"), timeout_s=20).verdict
    assert v.correct, (v.status, v.errors)


def test_an_honest_torch_compile_kernel_passes(guard):
    v = guard.evaluate(Candidate(source=COMPILED, language="pytorch"), timeout_s=240).verdict
    assert v.correct, (v.status, v.errors)


# -- NVIDIA's own check around an exported solution ------------------------------------------------


@pytest.fixture(scope="module")
def nvidia():
    """``check_thread_injection`` and the timed-input allocator, from the vendored harness."""
    if not (HARNESS_SRC / "sol_execbench" / "core" / "bench" / "reward_hack.py").is_file():
        pytest.skip("NVIDIA's harness is not vendored at ../shared/sol-execbench-harness")
    sys.path.insert(0, str(HARNESS_SRC))
    try:
        from sol_execbench.core.bench.io import ShiftingMemoryPoolAllocator
        from sol_execbench.core.bench.reward_hack import RewardHackDetected, check_thread_injection
    except ImportError as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"NVIDIA's harness does not import here: {e}")
    finally:
        sys.path.remove(str(HARNESS_SRC))
    return check_thread_injection, RewardHackDetected, ShiftingMemoryPoolAllocator


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


def _nvidia_workload(run, task, wl: int, check, allocator_cls, timed: int = 20) -> None:
    """One workload as NVIDIA's eval driver runs it: round 0, the thread count, rounds 1-9 on fresh
    inputs, then the timed calls on its shifted-pointer inputs, then ``check_thread_injection``."""
    shapes = [(task.shape(n, wl), torch_dtype(o.dtype)) for n, o in task.definition.outputs.items()]

    def call(args):
        outs = [torch.empty(s, dtype=d) for s, d in shapes]
        run(*args, *outs)
        return outs

    call(make_inputs(task, wl, 0, "cpu"))
    before = threading.active_count()
    for r in range(1, 10):
        call(make_inputs(task, wl, r, "cpu"))
    alloc = allocator_cls(make_inputs(task, wl, 11, "cpu"), [torch.empty(s, dtype=d) for s, d in shapes], timed)
    for _ in range(timed):
        run(*alloc.get_unique_args())
    check(before, threading.active_count())


def test_nvidia_check_passes_the_exported_composed_solution(tmp_path, nvidia):
    check, _, allocator_cls = nvidia
    task, out = _export_composed(tmp_path)
    kernel = (out / "kernelarc_kernel.py").read_text()
    assert kernel.count("compile_threads = 1") == 1
    sys.path.insert(0, str(out))
    try:
        import main
        from torch._inductor.async_compile import AsyncCompile

        # what Inductor's Triton path asks at each compile on the GPU: with one compile thread, no pool
        assert torch._inductor.config.compile_threads == 1 and not AsyncCompile.use_process_pool()
        for wl in range(len(task.workloads)):
            _nvidia_workload(main.run, task, wl, check, allocator_cls)
        assert not [t.name for t in threading.enumerate() if t.name in ("InductorSubproc", "subproc_worker_timer")]
    finally:
        sys.path.remove(str(out))
        for name in ("main", "kernelarc_kernel"):
            sys.modules.pop(name, None)


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
    pooled = POOL_SCRIPT.format(harness=str(HARNESS_SRC), threads=2)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(pooled)], capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("REWARD_HACK") and "subproc_worker_timer" in r.stdout, (r.stdout, r.stderr[-2000:])
    single = POOL_SCRIPT.format(harness=str(HARNESS_SRC), threads=1).replace("+ 60", "+ 5")
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(single)], capture_output=True, text=True, timeout=120)
    assert r.stdout.startswith("PASSED"), (r.stdout, r.stderr[-2000:])
