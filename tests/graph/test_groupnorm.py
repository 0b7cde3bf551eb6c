"""GroupNorm sites (``kernelarc.graph.groupnorm``) and their family (``kernelarc.families.groupnorm``): the aten op and
the written-out form recognised with the SiLU and residual add after them, the composed candidate checked against
the reference on the CPU (Triton's interpreter), the kernel on rows cut into several spans and on a mean far from
zero, and both kernels compiled for sm_90a without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from _problems import make_task
from shared_dirs import SKIP_REASON, shared_path

from kernelarc.families import families_for
from kernelarc.families.composed import recognise, start_points
from kernelarc.families.groupnorm import SPLIT
from kernelarc.graph.patterns import Kind
from kernelarc.guard.static import check_source
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

SOL = shared_path("sol-execbench")
needs_sol = pytest.mark.skipif(not SOL.is_dir(), reason=f"sol-execbench {SKIP_REASON}")

# conv -> GroupNorm -> SiLU -> + x, as L1/002 writes it (one conv: the site is what follows it)
ATEN = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(x, cw, w, b):
    h = F.conv2d(x, cw, padding=1)
    return F.silu(F.group_norm(h, 4, w, b, 1e-6)) + x
"""

# GroupNorm written out (view to groups, mean and population variance, view back, per-channel affine), as L1/089
MANUAL = """
import torch

@torch.no_grad()
def run(x, w, b):
    B, C, H, W = x.shape
    v = x.view(B, 4, C // 4, H, W)
    mean = v.mean(dim=[2, 3, 4], keepdim=True)
    var = v.var(dim=[2, 3, 4], keepdim=True, unbiased=False)
    y = ((v - mean) / torch.sqrt(var + 1e-5)).view(B, C, H, W)
    return y * w.view(1, C, 1, 1) + b.view(1, C, 1, 1)
"""

# the sample variance (Bessel's correction): not GroupNorm, not recognised as one
SAMPLE_VAR = MANUAL.replace("unbiased=False", "unbiased=True")
# an affine along the last axis, not the channels' (W == C): the norm is a site, the affine stays the graph's
WIDTH_AFFINE = MANUAL.replace("w.view(1, C, 1, 1) + b.view(1, C, 1, 1)", "w.view(1, 1, 1, W) + b.view(1, 1, 1, W)")


def _task(tmp_path: Path, name: str, ref: str, dtype: str):
    ins = {"x": (["B", 16, "H", "W"], dtype), "w": ([16], dtype), "b": ([16], dtype)}
    if "cw" in ref:
        ins = {"x": ins["x"], "cw": ([16, 16, 3, 3], dtype), "w": ins["w"], "b": ins["b"]}
    return make_task(tmp_path, name, ref, ins, {"y": (["B", 16, "H", "W"], dtype)},
                     [{"B": 2, "H": 12, "W": 10}, {"B": 1, "H": 33, "W": 7}])  # fmt: skip


def _sites(task):
    return [s for s in recognise(task).sites[0] if s.kind is Kind.group_norm]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", ["aten", "manual"])
def test_group_norm_sites_compose_and_match_the_reference(tmp_path, form, dtype):
    task = _task(tmp_path, f"gn_{form}_{dtype}", ATEN if form == "aten" else MANUAL, dtype)
    (site,) = _sites(task)
    assert site.params["form"] == form and site.params["groups"] == 4
    assert (site.params["act"], site.params["residual"]) == (("silu", True) if form == "aten" else ("none", False))
    assert site.inputs["weight"] is not None and site.inputs["bias"] is not None
    fams = families_for(task)
    fam = next(f for f in fams if f.name.endswith(".group_norm.split"))
    assert start_points(task, fams)[0][0] is fam  # the kernel family leads
    src = fam.render(fam.check_point({**fam.start, "rest": "eager"}))
    assert check_source(src).ok
    mod = load_module(src, f"gn_{form}_{dtype}")
    calls = []
    real = mod._k0_run
    mod._k0_run = lambda *a: calls.append(1) or real(*a)
    ref = load_module(task.definition.reference, f"ref_gn_{form}_{dtype}")
    for i in range(len(task.workloads)):
        args = make_inputs(task, i, 5, "cpu")
        got, want = mod.run(*args), ref.run(*args)
        assert got.dtype == want.dtype and got.shape == want.shape
        err = (got.double() - want.double()).abs().max().item()
        # fp32: summation order only; bf16: one rounding step of the largest value
        bound = 1e-5 if dtype == "float32" else 2**-7 * want.double().abs().max().item()
        assert err <= bound * max(1.0, want.double().abs().max().item()), (i, err)
    assert len(calls) == len(task.workloads)  # the kernel ran, no fallback


def test_the_sample_variance_is_not_a_group_norm(tmp_path):
    assert _sites(_task(tmp_path, "gn_sample", SAMPLE_VAR, "float32")) == []


def test_an_affine_along_another_axis_is_not_the_norms(tmp_path):
    task = make_task(tmp_path, "gn_width", WIDTH_AFFINE,
                     {"x": (["B", 16, "H", 16], "float32"), "w": ([16], "float32"), "b": ([16], "float32")},
                     {"y": (["B", 16, "H", 16], "float32")}, [{"B": 2, "H": 12}])  # fmt: skip
    (site,) = _sites(task)
    assert site.inputs["weight"] is None and site.inputs["bias"] is None


@pytest.mark.parametrize("spans", [1, 64])
def test_the_kernel_over_spans_and_a_mean_far_from_zero(spans):
    mod = load_module(SPLIT.render(SPLIT.start), f"gn_spans_{spans}")
    mod.PROGRAMS_PER_SM = spans  # 64: each (sample, group) row cut into several spans
    g = torch.Generator().manual_seed(spans)
    for dtype, shape, groups, act, res in [(torch.float32, (1, 16, 33, 17), 4, "silu", True),
                                           (torch.bfloat16, (2, 8, 64, 9), 2, "none", False),
                                           (torch.float16, (3, 6, 50), 3, "silu", False)]:  # fmt: skip
        x = (torch.randn(shape, generator=g) * 0.5 + 100.0).to(dtype)  # |mean| / std = 200
        w, b = torch.randn(shape[1], generator=g).to(dtype), torch.randn(shape[1], generator=g).to(dtype)
        r = torch.randn(shape, generator=g).to(dtype) if res else None
        want = F.group_norm(x.double(), groups, w.double(), b.double(), 1e-6)
        want = F.silu(want) if act == "silu" else want
        want = want + r.double() if res else want
        got = mod.run(x, w, b, groups, 1e-6, act, r)
        assert got.dtype == dtype
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        assert (got.double() - want).abs().max().item() <= tol * want.abs().max().item(), (dtype, shape)


def test_both_kernels_compile_for_sm90a(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
    from _aot import aot_compile

    d16 = [["tt.divisibility", 16]]
    items = []
    # eps as Triton passes a Python float (fp32) and as Inductor does from a compiled graph (fp64: trace_kernels)
    for dt, eps in (("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "fp64")):
        for k in (SPLIT.start, {**SPLIT.start, "BLOCK": 8192, "num_warps": 16}):
            stats = {
                "x_ptr": f"*{dt}",
                "part_ptr": "*fp32",
                "L": "i32",
                "CHUNK": "i32",
                "S": "i32",
                "BLOCK": "constexpr",
            }
            apply = {"x_ptr": f"*{dt}", "w_ptr": f"*{dt}", "b_ptr": f"*{dt}", "r_ptr": f"*{dt}", "y_ptr": f"*{dt}",
                     "part_ptr": "*fp32", "L": "i32", "HW": "i32", "CG": "i32", "G": "i32", "CHUNK": "i32", "S": "i32",
                     "eps": eps}  # fmt: skip
            consts = {"HAS_W": True, "HAS_B": True, "HAS_R": True, "SILU": True, "ROUND": dt != "fp32", "S_POW": 8,
                      "BLOCK": k["BLOCK"]}  # fmt: skip
            apply.update({n: "constexpr" for n in consts})
            opts = {"num_warps": k["num_warps"]}
            jobs = [dict(kernel="_gn_stats", signature=stats, constexprs={"BLOCK": k["BLOCK"]},
                         attrs={(0,): d16, (1,): d16, (2,): d16}, options=opts),
                    dict(kernel="_gn_apply", signature=apply, constexprs=consts,
                         attrs={(0,): d16, (4,): d16, (6,): d16}, options=opts)]  # fmt: skip
            items.append((f"{dt}_{eps}_{k['BLOCK']}", SPLIT.render(k), jobs))
    results = aot_compile(items, tmp_path)
    for label, res in results.items():
        for r in res:
            assert "error" not in r, (label, r.get("error"))
            assert r["sm90a"], label


@needs_sol
@pytest.mark.parametrize(
    ("name", "want"),
    [("L1/002_vae_conv3x3_groupnorm_silu_residual_fused", [("silu", False), ("silu", True)]),
     ("L1/089_vae_attention_block_with_groupnorm", [("none", False)])],
)  # fmt: skip
def test_sol_execbench_group_norms_are_recognised(name, want):
    task = load_task(SOL / name, cpu=True)
    assert [(s.params["act"], s.params["residual"]) for s in _sites(task)] == want
    assert any(f.name.endswith(".group_norm.split") for f in families_for(task))
