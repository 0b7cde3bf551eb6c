"""Scaled fp8 GEMM recognition (``kernelarc.graph.quant``) and its composition onto the fp8 GEMM
family, interpreted Triton on the CPU, checked against a float64 dequantise-then-matmul."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _problems import make_task, spied_family_module
from shared_dirs import SKIP_REASON, shared_path

from kernelarc.families import families_for
from kernelarc.families.composed import recognise
from kernelarc.graph.adapters import Impl, family_ok
from kernelarc.graph.patterns import Kind
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

# blockwise 1x128 activations, 128x128 weights, written with indexing instead of unsqueeze and
# mm instead of matmul (the recogniser reads structure, not the author's spelling)
BLOCKWISE = """
import torch

@torch.no_grad()
def run(a, w, sa, sw):
    M, K = a.shape
    N = w.shape[0]
    af = (a.to(torch.float32).view(M, 1, K // 128, 128) * sa[:, None, :, None]).view(M, K)
    wf = (w.to(torch.float32).view(N // 128, 128, K // 128, 128) * sw[:, None, :, None]).view(N, K)
    return torch.mm(af, wf.t()).to(torch.bfloat16)
"""

# per-row activation scales, a per-tensor weight scale, a bias, fp32 output
OUTER = """
import torch

@torch.no_grad()
def run(a, w, sa, sw, bias):
    y = (a.float() * sa.unsqueeze(1)) @ (w.float() * sw).T
    return y + bias
"""

# 1x64 activation blocks: no fp8 family reads them
BLOCK64 = """
import torch

@torch.no_grad()
def run(a, w, sa, sw):
    M, K = a.shape
    N = w.shape[0]
    af = (a.to(torch.float32).view(M, 1, K // 64, 64) * sa[:, None, :, None]).view(M, K)
    wf = (w.to(torch.float32).view(N // 128, 128, K // 128, 128) * sw[:, None, :, None]).view(N, K)
    return torch.mm(af, wf.t())
"""


def _f64_blockwise(a, w, sa, sw):
    M, K = a.shape
    N = w.shape[0]
    af = (a.double().view(M, 1, K // 128, 128) * sa.double()[:, None, :, None]).view(M, K)
    wf = (w.double().view(N // 128, 128, K // 128, 128) * sw.double()[:, None, :, None]).view(N, K)
    return af @ wf.T


def _run_counted(task, suffix: str, args):
    # the family kernel, not the site's fallback, must compute the product
    mod, calls = spied_family_module(task, suffix, start=True, name="composed")
    out = mod.run(*args)
    return out, len(calls)


def _positive_scales(args, idx):
    # fresh positive scales (dequantisation scales are amax / 448 > 0)
    for i in idx:
        args[i] = args[i].abs() + 0.01
    return args


def test_blockwise_fp8_gemm_runs_on_the_fp8_family(tmp_path):
    task = make_task(
        tmp_path, "p_fp8_block", BLOCKWISE,
        {"a": (["M", "K"], "float8_e4m3fn"), "w": (["N", "K"], "float8_e4m3fn"),
         "sa": (["M", "KB"], "float32"), "sw": (["NB", "KB"], "float32")},
        {"y": (["M", "N"], "bfloat16")},
        [{"M": 24, "K": 256, "N": 128, "KB": 2, "NB": 1}, {"M": 7, "K": 128, "N": 256, "KB": 1, "NB": 2}],
    )  # fmt: skip
    rec = recognise(task)
    sites = [s for s in rec.sites[0] if s.kind is Kind.fp8_gemm]
    assert len(sites) == 1 and sites[0].params["mode"] == "block" and family_ok(sites[0]) is None
    assert Impl.family in rec.impls[id(sites[0])]
    assert not [s for s in rec.sites[0] if s.kind is Kind.gemm]  # the matmul belongs to the fp8 site
    names = [f.name for f in families_for(task)]
    assert "composed.p_fp8_block.fp8_matmul.tiled" in names
    for i in (0, 1):
        args = _positive_scales(make_inputs(task, i, 3, "cpu"), (2, 3))
        got, calls = _run_counted(task, "fp8_matmul.tiled", args)
        want = _f64_blockwise(*args)
        assert calls == 1 and got.dtype == torch.bfloat16 and got.shape == want.shape
        scale = want.abs().max().item()
        torch.testing.assert_close(got.double(), want, atol=1e-2 * scale, rtol=1e-2)


def test_per_row_and_per_tensor_scales_with_bias(tmp_path):
    task = make_task(
        tmp_path, "p_fp8_outer", OUTER,
        {"a": (["M", "K"], "float8_e4m3fn"), "w": (["N", "K"], "float8_e4m3fn"),
         "sa": (["M"], "float32"), "sw": ([1], "float32"), "bias": (["N"], "float32")},
        {"y": (["M", "N"], "float32")},
        [{"M": 9, "K": 64, "N": 40}],
    )  # fmt: skip
    rec = recognise(task)
    (site,) = [s for s in rec.sites[0] if s.kind is Kind.fp8_gemm]
    assert site.params["mode"] == "outer" and site.params["bias"]
    assert (site.params["scaling_a"], site.params["scaling_b"]) == ("row", "tensor")
    args = _positive_scales(make_inputs(task, 0, 5, "cpu"), (2, 3))
    got, calls = _run_counted(task, "fp8_matmul.tiled", args)
    a, w, sa, sw, bias = args
    want = (a.double() * sa.double()[:, None]) @ (w.double() * sw.double()).T + bias.double()
    assert calls == 1 and got.dtype == torch.float32
    # the family's product is rounded to bf16 before the bias: a bf16 tolerance on the output's range
    torch.testing.assert_close(got.double(), want, atol=1e-2 * want.abs().max().item(), rtol=1e-2)


def test_unsupported_block_shape_is_not_an_fp8_site(tmp_path):
    task = make_task(
        tmp_path, "p_fp8_b64", BLOCK64,
        {"a": (["M", "K"], "float8_e4m3fn"), "w": (["N", "K"], "float8_e4m3fn"),
         "sa": (["M", "KB"], "float32"), "sw": (["NB", "KC"], "float32")},
        {"y": (["M", "N"], "float32")},
        [{"M": 8, "K": 256, "N": 128, "KB": 4, "NB": 1, "KC": 2}],
    )  # fmt: skip
    rec = recognise(task)
    assert not [s for s in rec.sites[0] if s.kind is Kind.fp8_gemm]
    assert not [f for f in families_for(task) if "fp8_matmul" in f.name]


# an MoE expert as Quant/004 writes it: the gate-up product is quantised again (blockwise e4m3) for the
# down projection, so a difference of one bf16 ulp in it moves whole fp8 steps downstream
MOE_FP8 = """
import torch
import torch.nn.functional as F

def _quant(x, bm):
    R, C = x.shape
    xb = x.reshape(R // bm, bm, C // 128, 128)
    s = (xb.abs().amax(dim=3).amax(dim=1) / 448.0).clamp(min=1e-12)
    q = (xb / s.unsqueeze(1).unsqueeze(3)).clamp(-448.0, 448.0).reshape(R, C).to(torch.float8_e4m3fn)
    return q, s

def _mm(qa, sa, qb, sb):
    M, K = qa.shape
    N = qb.shape[0]
    a = (qa.to(torch.float32).reshape(M, 1, K // 128, 128) * sa.unsqueeze(1).unsqueeze(3)).reshape(M, K)
    b = (qb.to(torch.float32).reshape(N // 128, 128, K // 128, 128) * sb.unsqueeze(1).unsqueeze(3)).reshape(N, K)
    return (a @ b.T).to(torch.bfloat16)

@torch.no_grad()
def run(x, r, w1, w2):
    qx, sx = _quant(x.float(), 1)
    q1, s1 = _quant(w1.float(), 128)
    g, u = _mm(qx, sx, q1, s1).chunk(2, dim=-1)
    qa, sa = _quant((F.silu(g) * u).float(), 1)
    q2, s2 = _quant(w2.float(), 128)
    return _mm(qa, sa, q2, s2) * r
"""


def _moe_task(tmp_path):
    return make_task(
        tmp_path, "p_moe_fp8", MOE_FP8,
        {"x": (["T", "H"], "bfloat16"), "r": (["T", 1], "bfloat16"), "w1": (["I2", "H"], "bfloat16"),
         "w2": (["H", "I"], "bfloat16")},
        {"y": (["T", "H"], "bfloat16")},
        [{"T": 128, "H": 256, "I2": 512, "I": 256}],
        tolerance={"max_atol": 0.005, "max_rtol": 0.02, "required_matched_ratio": 0.99},  # Quant/004's
    )  # fmt: skip


def test_a_requantised_fp8_product_starts_on_exact_bf16_mmas(tmp_path):
    task = _moe_task(tmp_path)
    rec = recognise(task)
    sites = [s for s in rec.sites[0] if s.kind is Kind.fp8_gemm]
    assert [s.params["requant"] for s in sites] == [True, False]  # gate-up is quantised again, down is not
    for suffix in ("fp8_matmul.tiled", "fp8_matmul.persistent_tma"):
        fam = next(f for f in families_for(task) if f.name.endswith(suffix))
        assert fam.start["MMA"] == "bf16", suffix
        assert "MMA_BF16 = tl.constexpr(True)" in fam.render(fam.start)
        assert "MMA_BF16 = tl.constexpr(False)" in fam.render(fam.check_point({"MMA": "fp8"}))
    # a product nothing quantises again keeps the fp8 tensor cores
    single = make_task(
        tmp_path, "p_fp8_single", BLOCKWISE,
        {"a": (["M", "K"], "float8_e4m3fn"), "w": (["N", "K"], "float8_e4m3fn"),
         "sa": (["M", "KB"], "float32"), "sw": (["NB", "KB"], "float32")},
        {"y": (["M", "N"], "bfloat16")}, [{"M": 8, "K": 128, "N": 128, "KB": 1, "NB": 1}],
    )  # fmt: skip
    fam = next(f for f in families_for(single) if f.name.endswith("fp8_matmul.tiled"))
    assert fam.start["MMA"] == "fp8"


def test_requantised_chain_matches_the_reference_at_its_tolerance(tmp_path):
    # Interpreted, both MMA modes multiply exactly; what this catches is the output rounding: the
    # interpreter's fp32 -> bf16 cast truncates, which matched 58-79% of elements here (the kernels
    # now round to nearest even by hand under the interpreter, as the GPU's cvt.rn does)
    task = _moe_task(tmp_path)
    ref = load_module(task.definition.reference, "ref_moe_fp8")
    for suffix, mma in (("fp8_matmul.tiled", "bf16"), ("fp8_matmul.persistent_tma", "bf16"),
                        ("fp8_matmul.tiled", "fp8")):  # fmt: skip
        mod, calls = spied_family_module(task, suffix, {"rest": "eager", "MMA": mma}, name=f"moe_{mma}")
        for seed in (1, 2):
            args = make_inputs(task, 0, seed, "cpu")
            got, want = mod.run(*args), ref.run(*args)
            ok = torch.isclose(got.float(), want.float(), atol=0.005, rtol=0.02).float().mean().item()
            assert ok >= 0.99, (suffix, mma, seed, ok)
        assert len(calls) == 4, (suffix, calls)  # both GEMMs on the family kernel, per call


_AOT_BF16 = r"""
import importlib.util, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernelarc.families import fp8_gemm as fg
out = []
for i, fam in enumerate(fg.FAMILIES):
    k = fam.check_point({"MMA": "bf16"})
    path = f"{sys.argv[1]}/aot_bf16_{i}.py"
    open(path, "w").write(fam.render(k))
    spec = importlib.util.spec_from_file_location(f"aot_bf16_{i}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    job = fg.aot_jobs(fam.name, k, 4096, 4096, 4096)[0]
    src = ASTSource(fn=getattr(mod, job["kernel"]), signature=job["signature"], constexprs=job["constexprs"],
                    attrs=job["attrs"])
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=job["options"]).asm["ptx"]
    out.append(sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.([\w.]+)", ptx))))
print("AOT " + json.dumps(out))
"""


def test_exact_mma_compiles_to_bf16_wgmma_for_sm90a(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2]) + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run([sys.executable, "-c", _AOT_BF16, str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("AOT ")).removeprefix("AOT "))
    # the upcast tiles reach the tensor cores as bf16 (fp32 accumulator), no e4m3 wgmma left
    assert res == [["m64n64k16.f32.bf16.bf16"], ["m64n64k16.f32.bf16.bf16"]], res


def test_quant_004_starts_its_fp8_families_on_exact_mmas():
    sol = shared_path("sol-execbench")
    if not sol.is_dir():
        pytest.skip(f"sol-execbench {SKIP_REASON}")
    task = load_task(sol / "Quant/004_fp8_moe_expert_linear")
    rec = recognise(task)
    assert [s.params["requant"] for s in rec.sites[0] if s.kind is Kind.fp8_gemm] == [True, False]

    def triton_fp8(t):
        return [f for f in families_for(t) if ".fp8_matmul." in f.name and "cutlass" not in f.name]

    fams = triton_fp8(task)
    assert len(fams) == 2 and all(f.start["MMA"] == "bf16" for f in fams)
    # their fp8 products feed no second quantisation: the fp8 tensor cores stay the start
    for other in ("Quant/003_fp8_mlp_gate_up_projection", "Quant/015_fp8_mla_attention_output_projection"):
        fams = triton_fp8(load_task(sol / other))
        assert fams and all(f.start["MMA"] == "fp8" for f in fams), other
