"""CUTLASS softmax family (rows staged in shared memory by bulk copies): knob space, feasibility,
rendering, guard compatibility, and real sm_90a builds with nvcc (skipped where nvcc or the headers
are missing; about 5 s per build). Correctness runs on the H200: tests/test_gpu.py."""

from __future__ import annotations

import ctypes
import itertools

import pytest

from kernelarc import cutlass
from kernelarc.families.cutlass_softmax import CUTLASS_SOFTMAX, render_cpp, smem_bytes, valid
from kernelarc.guard.static import check_source
from kernelarc.models import Candidate

needs_toolchain = pytest.mark.skipif(not cutlass.available(), reason="needs nvcc and nvidia-cutlass headers")


def test_knob_space_is_wide_and_the_start_holds_the_longest_task_row():
    fam = CUTLASS_SOFTMAX
    start = fam.check_point({})
    assert valid(start)
    # the start's stage holds a whole 32768-wide bf16 row (the task's longest), so it takes the staged path
    assert start["STAGE_KB"] * 1024 >= 32768 * 2
    names = [k.name for k in fam.knobs]
    points = [dict(zip(names, vals, strict=True)) for vals in itertools.product(*[k.values for k in fam.knobs])]
    feasible = [p for p in points if valid(p)]
    assert len(points) >= 10_000 and 0.2 < len(feasible) / len(points) < 0.9
    assert {k.strategy for k in fam.knobs} >= {"tiling", "scheduling", "memory", "precision"}


@pytest.mark.parametrize(
    "point, ok",
    [
        (dict(STAGES=3, STAGE_KB=64), True),  # 192 KB of stages in one CTA
        (dict(STAGES=4, STAGE_KB=64), False),  # 256 KB: over the 227 KB a CTA may have
        (dict(STAGES=2, STAGE_KB=64, CTAS_PER_SM=2), False),  # two CTAs of 129 KB: over the SM's 228 KB
        (dict(STAGES=3, STAGE_KB=32, CTAS_PER_SM=2, THREADS=512), True),
        (dict(STAGES=1, STAGE_KB=64, CTAS_PER_SM=3, THREADS=512), True),  # 40 registers a thread
        (dict(STAGES=3, STAGE_KB=32, CTAS_PER_SM=2, THREADS=1024), False),  # 32 registers a thread: spills
        (dict(STAGES=1, STAGE_KB=48, CTAS_PER_SM=4, THREADS=256), True),
        (dict(EXP_CACHE="fp16"), True),
        (dict(EXP_CACHE="fp16", STATS="online"), False),  # the cache needs the row's final max
    ],
)
def test_feasibility_rules(point, ok):
    assert valid(CUTLASS_SOFTMAX.check_point(point)) is ok


def test_rendered_candidate_places_every_knob_and_passes_the_static_checks():
    k = CUTLASS_SOFTMAX.check_point(
        dict(THREADS=1024, STAGES=3, STAGE_KB=48, ELEMS_PER_THREAD=16, STORE="bulk", EXP="exp2", NORMALIZE="mul_rcp")
    )
    cpp = render_cpp(k)
    assert "$" not in cpp
    for line in (
        "kThreads = 1024;",
        "kStages = 3;",
        "kStageBytes = 48 * 1024;",
        "kCtasPerSm = 1;",
        "kElemsPerThread = 16;",
        "kStore = 2;",
        "kExp2 = true;",
        "kMulRcp = true;",
        "kEvictFirst = false;",
        "kOnline = false;",
        "kUnroll = 1;",
        "kExpCache = false;",
    ):
        assert line in cpp, line
    assert smem_bytes(k) == 3 * 48 * 1024 + 1024
    src = CUTLASS_SOFTMAX.render(k)
    report = check_source(src)
    assert report.ok, report.violations
    assert Candidate(source=src, language="cutlass", family=CUTLASS_SOFTMAX.name, knobs=k).language == "cutlass"


class _FakeKernel:
    def __init__(self):
        self.calls = []

    def __call__(self, inputs, outputs, dims):
        (x,), (y,), (m, n) = inputs, outputs, dims
        assert x.is_contiguous() and x.data_ptr() % 16 == 0 and x.shape == (m, n) == y.shape
        self.calls.append((m, n))
        y.copy_(x.float().softmax(-1).to(y.dtype))


def test_launcher_aligns_views_and_rejects_what_the_kernel_cannot_take(monkeypatch):
    import torch

    from kernelarc.tasks.inputs import load_module

    fake = _FakeKernel()
    monkeypatch.setattr(cutlass, "load", lambda source, arch=cutlass.ARCH: fake)
    mod = load_module(CUTLASS_SOFTMAX.render(CUTLASS_SOFTMAX.start), "cutlass_softmax_start")
    base = torch.randn(5, 41, dtype=torch.bfloat16)
    view = base[:, 1:]  # starts 2 bytes into the buffer, rows not contiguous
    out = mod.run(view)
    assert fake.calls == [(5, 40)]
    torch.testing.assert_close(out, view.float().softmax(-1).to(torch.bfloat16))
    assert mod.run(torch.empty(0, 8, dtype=torch.bfloat16)).shape == (0, 8) and len(fake.calls) == 1
    with pytest.raises(ValueError, match="bf16"):
        mod.run(torch.randn(4, 8))


@needs_toolchain
@pytest.mark.parametrize(
    "point",
    [
        {},
        dict(THREADS=1024, STAGES=3, STORE="bulk", EXP="exp2", NORMALIZE="mul_rcp"),
        dict(THREADS=512, STAGES=3, STAGE_KB=32, CTAS_PER_SM=2, STORE="st_cs", ELEMS_PER_THREAD=8),
        dict(THREADS=512, STAGES=1, CTAS_PER_SM=3, UNROLL=4, STATS="online", EXP="exp2", NORMALIZE="mul_rcp"),
        dict(EXP_CACHE="fp16", STORE="bulk", THREADS=1024, UNROLL=4),
    ],
)
def test_points_build_for_sm90a_without_spills(point, tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELARC_CUTLASS_CACHE", str(tmp_path / "cache"))
    lib = cutlass.build(render_cpp(CUTLASS_SOFTMAX.check_point(point)))
    usage = cutlass.resource_usage(lib)
    assert usage["kernels"] == 2 and usage["spill_bytes"] == 0 and usage["registers"] <= 64, usage
    log = lib.with_name("build.log").read_text()
    assert "softmax_tiles_kernel" in log and "softmax_rows_plain_kernel" in log
    handle = ctypes.CDLL(str(lib))  # loads without a GPU (cudart is linked statically)
    assert handle.kernelarc_run and handle.kernelarc_workspace
