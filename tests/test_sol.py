"""Speed-of-light model: work counting from references, roofline, SOL score, SOLAR parity."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

from kernelarc.hardware import SOLAR_B200, GpuTarget, resolve_target
from kernelarc.sol import Work, count_work, io_bytes_of, sol_score, sol_terms, t_sol, task_work
from kernelarc.tasks import builtin_tasks, load_builtin, load_task
from kernelarc.tasks.inputs import load_module, make_inputs

SEB = Path(__file__).resolve().parents[1].parent / "shared" / "sol-execbench"
needs_seb = pytest.mark.skipif(not SEB.is_dir(), reason=f"{SEB} not present")


@pytest.fixture(scope="module")
def h200() -> GpuTarget:
    return resolve_target("h200", allow_missing=True)


def _ref(task):
    return load_module(task.definition.reference, "ref").run


# --------------------------------------------------------------------------- built-in tasks


def test_matmul_counts_2mnk_bf16():
    t = load_builtin("matmul", cpu=True)
    ref = _ref(t)
    for i in range(len(t.workloads)):
        ax = t.axes(i)
        inputs = make_inputs(t, i, 0, "cpu")
        w = count_work(ref, inputs)
        assert w.tc_flops == {"bfloat16": 2 * ax["M"] * ax["N"] * ax["K"]}
        assert w.simt_flops == {}
        assert w.flops == w.tc_total
        assert w.io_bytes == t.io_bytes(i)
        torch.testing.assert_close(w.output, ref(*inputs), rtol=0, atol=0)


def test_attention_counts_full_scores_in_bf16():
    # The reference upcasts q/k/v to fp32 before its matmuls: still a bf16 problem.
    t = load_builtin("attention", cpu=True)
    ref = _ref(t)
    for i in range(len(t.workloads)):
        ax = t.axes(i)
        w = count_work(ref, make_inputs(t, i, 0, "cpu"))
        expect = 4 * ax["B"] * ax["H"] * ax["S"] ** 2 * ax["D"]
        assert w.tc_flops == {"bfloat16": expect}, (ax, w.tc_flops)
        assert w.simt_flops.get("float32", 0) >= ax["B"] * ax["H"] * ax["S"] ** 2  # scale + softmax
        assert w.io_bytes == t.io_bytes(i)


def test_builtin_gpu_workloads_bounds(h200):
    """Full-size workloads counted on the meta device (no compute): the expected ceilings bind."""
    for i in range(len(load_builtin("matmul").workloads)):
        t = load_builtin("matmul")
        ax = t.axes(i)
        w = task_work(t, i, device="meta")
        assert w.tc_flops == {"bfloat16": 2 * ax["M"] * ax["N"] * ax["K"]}
        if min(ax.values()) >= 1024:
            assert t_sol(w, h200)[1] == "compute"
    t = load_builtin("attention")
    for i in range(len(t.workloads)):
        ax = t.axes(i)
        w = task_work(t, i, device="meta")
        assert w.tc_flops["bfloat16"] == 4 * ax["B"] * ax["H"] * ax["S"] ** 2 * ax["D"]
        assert t_sol(w, h200)[1] == "compute"
    for name in ("rmsnorm", "fused_add_rmsnorm", "softmax", "swiglu", "rope"):
        t = load_builtin(name)
        for i in range(len(t.workloads)):
            w = task_work(t, i, device="meta")
            s, bound = t_sol(w, h200)
            assert bound == "memory", (name, i)
            assert s == pytest.approx(t.io_bytes(i) / 4.8e12)


def test_rmsnorm_memory_bound_on_h200(h200):
    t = load_builtin("rmsnorm", cpu=True)
    for i in range(len(t.workloads)):
        w = count_work(_ref(t), make_inputs(t, i, 0, "cpu"))
        assert not w.tc_flops and w.simt_total > 0
        secs, bound = t_sol(w, h200)
        assert bound == "memory" and secs == pytest.approx(t.io_bytes(i) / 4.8e12)


def test_every_builtin_counts_on_cpu():
    for name in builtin_tasks():
        t = load_builtin(name, cpu=True)
        for i in range(len(t.workloads)):
            w = count_work(_ref(t), make_inputs(t, i, 0, "cpu"))
            assert w.flops > 0 and w.io_bytes == t.io_bytes(i), name


# --------------------------------------------------------------------------- counting rules


def test_precision_provenance():
    a = torch.randn(16, 32)
    b = torch.randn(32, 8)
    assert count_work(torch.matmul, [a, b]).tc_flops == {"float32": 2 * 16 * 32 * 8}
    # an fp8 weight dequantised to bf16 (cast, then scaled) makes an fp8 GEMM
    w8 = torch.randn(32, 8).to(torch.float8_e4m3fn)
    scale = torch.tensor(0.5, dtype=torch.bfloat16)

    def dequant_mm(x, w, s):
        return x @ (w.to(torch.bfloat16) * s)

    work = count_work(dequant_mm, [a.to(torch.bfloat16), w8, scale])
    assert work.tc_flops == {"float8_e4m3fn": 2 * 16 * 32 * 8}
    # a bool mask cast to float does not lower the precision of fp32 data
    mask = torch.rand(16, 32) > 0.5

    def masked_mm(x, m, y):
        return (x * m.to(torch.float32)) @ y

    assert count_work(masked_mm, [a, mask, b]).tc_flops == {"float32": 2 * 16 * 32 * 8}


def test_other_ops_and_free_ops():
    x = torch.randn(64, 128)
    w = count_work(lambda t: torch.exp(t) + 1.0, [x])
    assert w.simt_flops == {"float32": 2 * x.numel()}  # exp counts 1 per element, like add
    w = count_work(lambda t: t.sum(dim=-1), [x])
    assert w.simt_flops == {"float32": x.numel()}  # reductions: their input
    w = count_work(lambda t: t.t().contiguous().to(torch.bfloat16).view(-1), [x])
    assert w.flops == 0  # data movement is free
    w = count_work(torch.nn.functional.scaled_dot_product_attention, [torch.randn(2, 4, 16, 8)] * 3)
    assert w.tc_flops == {"float32": 4 * 2 * 4 * 16 * 16 * 8}


def test_linear_and_conv():
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    lin = torch.nn.Linear(32, 16, dtype=torch.bfloat16)
    with torch.no_grad():
        w = count_work(lin, [x])
    assert w.tc_flops == {"bfloat16": 2 * 4 * 32 * 16}
    img = torch.randn(1, 3, 8, 8)
    conv = torch.nn.Conv2d(3, 4, 3, padding=1)
    with torch.no_grad():
        w = count_work(conv, [img])
    assert w.tc_flops == {"float32": 2 * 8 * 8 * 4 * 3 * 9}


def test_io_bytes_unique_storages():
    x = torch.randn(10, 10)
    assert io_bytes_of(x, x, x.view(-1), x[:5]) == 400
    assert io_bytes_of(x[:5], x[5:]) == 400  # two halves of one buffer
    assert io_bytes_of(x[:3], x[7:]) == 240
    assert io_bytes_of(x, 3, 2.5, None, [x.t()]) == 400
    assert io_bytes_of(torch.randn(4).expand(8, 4)) == 16  # a broadcast view reads 16 bytes
    assert io_bytes_of(torch.empty(10, 10, device="meta"), torch.empty(3, device="meta")) == 412
    w = count_work(lambda a: a.add_(1.0), [x])  # in-place: output aliases the input
    assert w.io_bytes == 400


# --------------------------------------------------------------------------- roofline


def test_t_sol_terms():
    tgt = GpuTarget(
        name="toy", arch="sm_90a",
        peak_tflops={"bfloat16": 100.0, "float16": 100.0, "float32": 50.0},
        simt_tflops={"float32": 10.0}, hbm_tbps=1.0,
    )  # fmt: skip
    w = Work(tc_flops={"bfloat16": 100e12, "float32": 50e12}, simt_flops={"float32": 10e12}, io_bytes=1e12)
    assert w.flops == 160e12
    terms = sol_terms(w, tgt)  # fp32 MACs priced as fp16 (leaderboard policy): 1 + 0.5 + 1
    assert terms["t_tc"] == pytest.approx(1.5) and terms["t_simt"] == pytest.approx(1.0)
    assert t_sol(w, tgt) == (pytest.approx(2.5), "compute")
    assert t_sol(w, tgt, fp32_as="float32")[0] == pytest.approx(3.0)  # TF32 rate
    assert t_sol(w, tgt, simt=False)[0] == pytest.approx(1.5)
    w_mem = Work(tc_flops={"bfloat16": 1e12}, io_bytes=3e12)
    assert t_sol(w_mem, tgt) == (pytest.approx(3.0), "memory")
    assert t_sol(Work(), tgt) == (0.0, "memory")
    assert t_sol(w_mem, tgt, overhead_s=1e-6)[0] == pytest.approx(3.0 + 1e-6)


def test_calibrated_target_changes_t_sol(h200):
    w = Work(io_bytes=4.8e9)
    t = resolve_target("h200", allow_missing=True)
    assert t_sol(w, t)[0] == pytest.approx(1e-3)
    t.calibrated["copy_tbps"] = 4.0
    assert t_sol(w, t)[0] == pytest.approx(1.2e-3)


def test_sol_score():
    assert sol_score(2.0, 1.0, 2.0) == pytest.approx(0.5)
    assert sol_score(1.0, 1.0, 2.0) == pytest.approx(1.0)
    assert sol_score(1.5, 1.0, 2.0) == pytest.approx(1 / 1.5)
    assert sol_score(4.0, 1.0, 2.0) == pytest.approx(0.25)
    assert sol_score(0.5, 1.0, 2.0) == 1.0  # faster than SOL: clamped
    assert sol_score(1.0, 2.0, 1.0) == pytest.approx(0.5)  # baseline at/below SOL: vs baseline only
    assert sol_score(0.5, 2.0, 1.0) == pytest.approx(1 / 1.5)
    assert sol_score(3.0, 0.0, 3.0) == pytest.approx(0.5)
    for bad in ((0.0, 1.0, 2.0), (1.0, 1.0, -1.0), (math.nan, 1.0, 2.0), (1.0, -1.0, 2.0)):
        with pytest.raises(ValueError):
            sol_score(*bad)


# --------------------------------------------------------------------------- SOL-ExecBench


def _small_seb_problems():
    out = []
    for d in sorted(p for p in SEB.glob("*/*") if (p / "definition.json").is_file()):
        t = load_task(d)
        i = min(range(len(t.workloads)), key=t.io_bytes)
        if t.io_bytes(i) < 50e6:
            out.append((t, i))
    return out


def _check_work(t, i, w):
    assert w.flops > 0 and w.io_bytes == t.io_bytes(i), t.name
    assert all(v >= 0 for v in {**w.tc_flops, **w.simt_flops}.values())


@needs_seb
def test_sol_execbench_small_problems_count():
    """Every problem whose smallest workload moves < 50 MB is countable: custom-input
    problems (data-dependent shapes and routing) by really running the reference on the
    CPU, the rest on the meta device (same counts, no compute: see the next test)."""
    problems = _small_seb_problems()
    assert len(problems) >= 20
    on_cpu = 0
    for t, i in problems:
        custom = any(d.type == "custom" for d in t.workloads[i].inputs.values())
        w = task_work(t, i, device="cpu" if custom else "meta")
        on_cpu += custom
        _check_work(t, i, w)
    assert on_cpu >= 5


@needs_seb
@pytest.mark.parametrize(
    "problem",
    [
        "L1/013_fused_residual_rms_norm_backward",
        "L1/045_fused_linear_gelu_grn_linear",
        "L2/049_group_limited_topk_routing",
    ],
)
def test_meta_counts_equal_cpu_counts(problem):
    t = load_task(SEB / problem)
    i = min(range(len(t.workloads)), key=t.io_bytes)
    wm, wc = task_work(t, i, device="meta"), task_work(t, i, device="cpu")
    assert (wm.tc_flops, wm.simt_flops, wm.io_bytes) == (wc.tc_flops, wc.simt_flops, wc.io_bytes)


@needs_seb
@pytest.mark.skipif(not os.environ.get("KERNELARC_SLOW"), reason="set KERNELARC_SLOW=1 (4-16 s on 2 cores)")
def test_sol_execbench_small_problems_count_on_cpu_all():
    for t, i in _small_seb_problems():
        _check_work(t, i, task_work(t, i, device="cpu"))


@needs_seb
@pytest.mark.parametrize("problem", ["001_fused_add_rmsnorm_h2048", "024_rmsnorm_h2048", "010_gemm_n6144_k4096"])
def test_matches_solar_b200_metadata(problem):
    """With SOLAR's own B200 ceilings, no SIMT term and the ~0.4 µs the published numbers
    carry, T_SOL lands within 5 % of metadata sol_ms for every workload above 5 µs."""
    t = load_task(SEB / "FlashInfer-Bench" / problem)
    per = t.metadata["sol"]["per_workload"]
    checked = 0
    for i in range(len(t.workloads)):
        sol_ms = per[i]["sol_ms"]
        if sol_ms < 5e-3:
            continue
        w = task_work(t, i, device="meta")
        ours, _ = t_sol(w, SOLAR_B200, simt=False, overhead_s=4e-7)
        assert ours / (sol_ms * 1e-3) == pytest.approx(1.0, abs=0.05), (problem, t.workloads[i].axes)
        checked += 1
    assert checked >= 2
