"""Scaled fp8 GEMM recognition (``kernelarc.graph.quant``) and its composition onto the fp8 GEMM
family, interpreted Triton on the CPU, checked against a float64 dequantise-then-matmul."""

from __future__ import annotations

import torch
from _problems import make_task, spied_family_module

from kernelarc.families import families_for
from kernelarc.families.composed import recognise
from kernelarc.graph.adapters import Impl, family_ok
from kernelarc.graph.patterns import Kind
from kernelarc.tasks.inputs import make_inputs

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
