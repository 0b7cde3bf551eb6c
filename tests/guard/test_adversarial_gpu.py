"""Issue 15 on the GPU: the classes whose attack needs a device (side streams, CUDA timers, CUPTI),
and the CPU classes again on a GPU workload. ``pytest -m gpu tests/guard/test_adversarial_gpu.py``."""

from __future__ import annotations

import pytest
from shared_dirs import SKIP_REASON
from test_adversarial import (
    BAD,
    CACHE_PTR_VERSION,
    GOOD,
    HONEST,
    HONEST_STYLES,
    NVIDIA,
    SKIP_LATER_CALLS,
    _nvidia_samples,
)

from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.models import Candidate, Status
from kernelarc.tasks import load_builtin

pytestmark = pytest.mark.gpu

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
# Past the static checks (trusted=True): the runtime layers must catch these on their own.
SIDE_STREAM_WORK = """import torch
_S = torch.cuda.Stream()
_BIG = None
def run(x, weight):
    global _BIG
    if _BIG is None:
        _BIG = torch.randn(8192, 8192, device=x.device)
    y = torch.empty_like(x)
    _S.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(_S):  # the real work, plus a long matmul, after the timed region ends
        for _ in range(4):
            _BIG @ _BIG
        xf = x.float()
        y.copy_((xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype))
    return y
"""
PATCH_EVENTS_AT_RUN = (
    """import torch
def run(x, weight):
    torch.cuda.Event.elapsed_time = lambda self, end: 1e-4
"""
    + HONEST
)
# Knows where a burst ends: the judge talks to the worker between bursts (a long host gap; inside a burst
# calls follow each other within microseconds), so after one burst it knows the burst's length, and it
# works only on the burst's last call, the one the judge used to check. The judge now checks a call at a
# position of its own choosing: the empty outputs are seen.
BURST_END_ONLY = """import datetime
import torch
_S = {"last": 0.0, "cur": 0, "n": {}}
def run(x, weight):
    now = datetime.datetime.now().timestamp()
    key = tuple(x.shape)
    if now - _S["last"] > 0.0003:
        if _S["cur"] > 1:
            _S["n"][key] = _S["cur"]
        _S["cur"] = 0
    i = _S["cur"]
    _S["cur"] += 1
    n = _S["n"].get(key)
    if n is not None and i != n - 1:
        _S["last"] = datetime.datetime.now().timestamp()
        return torch.empty_like(x)
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.float()).to(x.dtype)
    _S["last"] = datetime.datetime.now().timestamp()
    return y
"""


@pytest.fixture(scope="module")
def guard():
    task = load_builtin("rmsnorm")
    g = Guard(task, None, "cuda:0", GuardConfig(workloads=[2], timeout_s=120))
    ref = g.evaluate(reference_candidate(task), trusted=True)
    assert ref.verdict.status is Status.champion, ref.verdict.errors
    g.set_baselines(ref, None)
    yield g
    g.close()


def test_honest_kernels_pass_with_cupti_or_events(guard):
    for src, lang in ((GOOD, "pytorch"), (TRITON_GOOD, "triton")):
        v = guard.evaluate(Candidate(source=src, language=lang), reference_candidate(guard.task)).verdict
        assert v.correct, (lang, v.errors)
        print(lang, v.status.value, f"{v.eval_seconds:.2f} s", v.phases, v.warnings)


@pytest.mark.parametrize(
    "src, trusted",
    [
        (SIDE_STREAM_WORK, True),
        (PATCH_EVENTS_AT_RUN, True),
        (CACHE_PTR_VERSION, False),
        (SKIP_LATER_CALLS, False),
        (BURST_END_ONLY, False),
    ],
    ids=[
        "side_stream_past_static",
        "patch_events_past_static",
        "cache_ptr_version",
        "skip_later_calls",
        "burst_end_only",
    ],  # fmt: skip
)
def test_gpu_cheats_are_rejected(guard, src, trusted):
    v = guard.evaluate(Candidate(source=src, language="pytorch"), reference_candidate(guard.task), trusted=trusted)
    if src is CACHE_PTR_VERSION:
        # On the H200 (2026-12-01) the memo already failed the correctness phase: a checked call's fresh inputs
        # land in a buffer whose pointer and version the memo had seen, so its stale output is `incorrect`
        # before the in-place rewrite test can call it a hack. Either way it is never accepted.
        assert v.verdict.status in (Status.incorrect, Status.rejected_hack), (v.verdict.status, v.verdict.errors)
        return
    assert v.verdict.status is Status.rejected_hack, (v.verdict.status, v.verdict.errors)


def test_nvidias_stream_injection_is_rejected_at_runtime_too(guard):
    """NVIDIA's sample imports `time` and makes a side stream (the static checks reject both); past the
    static checks, the CUPTI/event cross-check or the synchronised-wall check rejects it."""
    import json

    f = NVIDIA / "samples" / "rmsnorm" / "solution_hack_stream_injection.json"
    if not f.is_file():
        pytest.skip(f"NVIDIA's harness: {SKIP_REASON}")
    src = next(s["content"] for s in json.loads(f.read_text())["sources"] if s["path"].endswith(".py"))
    v = guard.evaluate(Candidate(source=src, language="pytorch"), reference_candidate(guard.task), trusted=True)
    assert v.verdict.status is Status.rejected_hack, (v.verdict.status, v.verdict.errors)


@pytest.mark.skipif(not NVIDIA.is_dir(), reason=f"NVIDIA's harness: {SKIP_REASON}")
@pytest.mark.parametrize("name, src", _nvidia_samples() or [("none", "")], ids=lambda x: x if len(x) < 40 else "")
def test_nvidias_cheating_samples_are_rejected_on_the_gpu(guard, name, src):
    """Issue 15's "NVIDIA's samples are rejected", on the device: the CPU test's samples, judged on a GPU workload."""
    if not src:
        pytest.skip("no samples found")
    v = guard.evaluate(Candidate(source=src, language="pytorch"), reference_candidate(guard.task), timeout_s=30)
    assert v.verdict.status is Status.rejected_hack, (name, v.verdict.status, v.verdict.errors)


@pytest.mark.parametrize("name", sorted(BAD))
def test_every_cpu_class_again_on_the_gpu(guard, name):
    """Issue 15: each known-bad kernel of tests/guard/test_adversarial.py, judged on a GPU workload by the
    GPU guard (CUPTI timing, CUDA inputs). Its CPU status is expected; a cheat that returns stale outputs
    may fail the correctness phase first on the GPU (``incorrect``), which is never an acceptance."""
    src, trusted, want = BAD[name]
    v = guard.evaluate(Candidate(source=src, language="pytorch"), reference_candidate(guard.task),
                       trusted=trusted, timeout_s=30).verdict  # fmt: skip
    print(name, v.status.value, v.errors[:1])
    assert not v.correct, (name, v.status)
    assert v.status is want or (want is Status.rejected_hack and v.status is Status.incorrect), (
        name,
        v.status,
        v.errors,
    )


@pytest.mark.parametrize("name", sorted(HONEST_STYLES))
def test_honest_styles_are_accepted_on_the_gpu(guard, name):
    v = guard.evaluate(Candidate(source=HONEST_STYLES[name], language="pytorch"), reference_candidate(guard.task),
                       timeout_s=60).verdict  # fmt: skip
    print(name, v.status.value, v.errors[:1])
    assert v.correct, (name, v.status, v.errors)
