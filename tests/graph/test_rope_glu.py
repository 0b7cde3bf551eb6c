"""RoPE and gated activations (GeGLU with the tanh and erf GELU) on the built-in RoPE / SwiGLU kernels,
composed over small problems and checked against the reference on fresh random inputs (Triton
interpreted on the CPU); forms no family computes (interleaved pairs, random cos / sin) are
recognised and stay on the graph's ops."""

from __future__ import annotations

import pytest
import torch
from _problems import make_task, spied_family_module
from test_compose import check

from kernelarc.families import families_for
from kernelarc.families.composed import recognise
from kernelarc.graph.adapters import Impl
from kernelarc.graph.patterns import Kind
from kernelarc.tasks.inputs import load_module, make_inputs


def kernel_calls(task, family_suffix: str, knobs: dict | None = None) -> int:
    """How often the composed candidate calls its family kernel (``_k0_run``) over the task's
    workloads, counted by a wrapper that calls through (so a silent fallback to the graph's ops fails)."""
    mod, calls = spied_family_module(task, family_suffix, knobs)
    for i in range(len(task.workloads)):
        mod.run(*make_inputs(task, i, 3, "cpu"))
    return len(calls)


def _rope_sites(task):
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    return [s for s in rec.sites[0] if s.kind is Kind.rope], rec


GEGLU_TANH = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(x):
    g, u = x.chunk(2, dim=-1)
    return F.gelu(g, approximate='tanh') * u
"""

GEGLU_ERF_MANUAL = """
import math
import torch

@torch.no_grad()
def run(x):
    h = x.shape[-1] // 2
    g = x[..., :h].float()
    u = x[..., h:].float()
    return (0.5 * g * (1.0 + torch.erf(g / math.sqrt(2.0))) * u).to(x.dtype)
"""


@pytest.mark.parametrize(
    ("ref", "dtype", "act", "tol"),
    [(GEGLU_TANH, "float32", "gelu_tanh", 1e-5), (GEGLU_ERF_MANUAL, "bfloat16", "gelu_none", 2e-2)],
)
def test_geglu_runs_on_the_swiglu_kernel_with_its_gelu(tmp_path, ref, dtype, act, tol):
    task = make_task(tmp_path, f"p_geglu_{act}", ref, {"x": (["B", "S", "F2"], dtype)}, {"y": (["B", "S", "F"], dtype)},
                     [{"B": 2, "S": 3, "F2": 128, "F": 64}, {"B": 1, "S": 5, "F2": 96, "F": 48}])  # fmt: skip
    rec = recognise(task)
    glu = [s for s in rec.sites[0] if s.kind is Kind.glu]
    assert len(glu) == 1 and glu[0].params["act"] == act and glu[0].params["packed"]
    assert Impl.family in rec.impls[id(glu[0])]
    src = check(task, "swiglu.tile2d", atol=tol, rtol=tol)
    assert kernel_calls(task, "swiglu.tile2d") == 2
    assert "_k0_run(" in src and "tl.exp(-g)" not in src.split("_swiglu_tile_kernel")[1].split("def run")[0]


ROPE_NEOX_BSHD = """
import torch

def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)

@torch.no_grad()
def run(q, position_ids, inv_freq):
    freqs = position_ids[..., None].float() * inv_freq[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos = emb.cos().to(q.dtype).unsqueeze(2)
    sin = emb.sin().to(q.dtype).unsqueeze(2)
    return q * cos + rotate_half(q) * sin
"""

ROPE_NEOX_BHSD_F32 = """
import torch

@torch.no_grad()
def run(q, inv_freq):
    S, D = q.shape[2], q.shape[3]
    t = torch.arange(S, device=q.device, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[None, None], emb.sin()[None, None]
    qf = q.float()
    rot = torch.cat((-qf[..., D // 2:], qf[..., : D // 2]), dim=-1)
    return (qf * cos + rot * sin).to(q.dtype)
"""

ROPE_SPLIT_HALVES = """
import torch

@torch.no_grad()
def run(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
"""


def test_rope_rotate_half_with_cos_built_from_positions_runs_on_the_rope_kernel(tmp_path):
    task = make_task(tmp_path, "p_rope_bshd", ROPE_NEOX_BSHD,
                     {"q": (["B", "S", "H", "D"], "bfloat16"), "position_ids": (["B", "S"], "int64"),
                      "inv_freq": (["D2"], "float32")},
                     {"y": (["B", "S", "H", "D"], "bfloat16")},
                     [{"B": 2, "S": 5, "H": 3, "D": 16, "D2": 8},
                      {"B": 1, "S": 7, "H": 4, "D": 32, "D2": 16}])  # fmt: skip
    sites, rec = _rope_sites(task)
    assert len(sites) == 1 and sites[0].params["style"] == "rotate_half" and sites[0].params["dup_halves"]
    names = [f.name for f in families_for(task)]
    assert "composed.p_rope_bshd.rope.fused_qk" in names and "composed.p_rope_bshd.rope.separate" in names
    src = check(task, "rope.fused_qk", atol=2e-2, rtol=2e-2)
    assert "_kernelarc_rope_layout(" in src
    assert kernel_calls(task, "rope.fused_qk") == 2
    check(task, "rope.separate", {"halves": "join"}, atol=2e-2, rtol=2e-2)


def test_rope_on_heads_first_layout_in_fp32(tmp_path):
    task = make_task(tmp_path, "p_rope_bhsd", ROPE_NEOX_BHSD_F32,
                     {"q": (["B", "H", "S", "D"], "bfloat16"), "inv_freq": (["D2"], "float32")},
                     {"y": (["B", "H", "S", "D"], "bfloat16")},
                     [{"B": 2, "H": 3, "S": 5, "D": 16, "D2": 8},
                      {"B": 1, "H": 2, "S": 6, "D": 8, "D2": 4}])  # fmt: skip
    sites, _ = _rope_sites(task)
    assert len(sites) == 1 and sites[0].params["dup_halves"]
    # the kernel reads q before the reference's .float() (its result is cast back to q's dtype)
    assert str(sites[0].inputs["x"].meta["val"].dtype) == "torch.bfloat16"
    check(task, "rope.fused_qk", atol=2e-2, rtol=2e-2)
    assert kernel_calls(task, "rope.fused_qk") == 2


def test_rope_split_halves_with_half_width_cos_inputs(tmp_path):
    task = make_task(tmp_path, "p_rope_split", ROPE_SPLIT_HALVES,
                     {"x": (["T", "H", "D"], "float32"), "cos": (["T", "D2"], "float32"),
                      "sin": (["T", "D2"], "float32")},
                     {"y": (["T", "H", "D"], "float32")},
                     [{"T": 6, "H": 3, "D": 16, "D2": 8}, {"T": 3, "H": 2, "D": 32, "D2": 16}])  # fmt: skip
    sites, _ = _rope_sites(task)
    assert len(sites) == 1 and sites[0].params["style"] == "split_halves"
    check(task, "rope.separate", atol=1e-5, rtol=1e-5)
    assert kernel_calls(task, "rope.separate") == 2


ROPE_RANDOM_COS = """
import torch

@torch.no_grad()
def run(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos[:, None, :] + rot * sin[:, None, :]
"""


def test_rope_with_arbitrary_cos_inputs_reads_both_halves_cos(tmp_path):
    # cos / sin as inputs may differ between the halves (random ones do): the kernels read each half's own
    # values (patch_rope_full_cos), checked against float64
    task = make_task(tmp_path, "p_rope_rand", ROPE_RANDOM_COS,
                     {"x": (["T", "H", "D"], "float32"), "cos": (["T", "D"], "float32"),
                      "sin": (["T", "D"], "float32")},
                     {"y": (["T", "H", "D"], "float32")},
                     [{"T": 6, "H": 3, "D": 16}, {"T": 3, "H": 2, "D": 8}])  # fmt: skip
    sites, rec = _rope_sites(task)
    assert len(sites) == 1 and not sites[0].params["dup_halves"]
    assert Impl.family in rec.impls.get(id(sites[0]), set())
    for suffix, knobs in (("rope.separate", {}), ("rope.fused_qk", {"halves": "join"})):
        assert kernel_calls(task, suffix, knobs) == 2
        fam = next(f for f in families_for(task) if f.name.endswith(suffix))
        mod = load_module(fam.render(fam.check_point(knobs)), f"full_cos_{suffix}")
        for i in (0, 1):
            x, cos, sin = make_inputs(task, i, 6, "cpu")
            xd, h = x.double(), x.shape[-1] // 2
            rot = torch.cat((-xd[..., h:], xd[..., :h]), dim=-1)
            want = xd * cos.double()[:, None, :] + rot * sin.double()[:, None, :]
            torch.testing.assert_close(mod.run(x, cos, sin).double(), want, atol=1e-5, rtol=1e-5)


ROPE_INTERLEAVED = """
import torch

@torch.no_grad()
def run(x, cos, sin):
    xe, xo = x[..., 0::2], x[..., 1::2]
    return torch.stack((xe * cos - xo * sin, xe * sin + xo * cos), dim=-1).flatten(-2)
"""

ROPE_COMPLEX = """
import torch

@torch.no_grad()
def run(x, freqs):
    fc = torch.polar(torch.ones_like(freqs), freqs)
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * fc).flatten(-2).to(x.dtype)
"""


ROPE_ROTATE_PAIRS = """
import torch

@torch.no_grad()
def run(x, cos, sin):
    rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos.repeat_interleave(2, dim=-1) + rot * sin.repeat_interleave(2, dim=-1)
"""


@pytest.mark.parametrize(
    ("ref", "style"),
    [(ROPE_INTERLEAVED, "interleaved"), (ROPE_ROTATE_PAIRS, "interleaved"), (ROPE_COMPLEX, "interleaved_complex")],
)
def test_interleaved_rope_is_recognised(tmp_path, ref, style):
    ins = {"x": (["T", "D"], "float32"), "cos": (["T", "D2"], "float32"), "sin": (["T", "D2"], "float32")}
    if "freqs" in ref:
        ins = {"x": (["T", "D"], "float32"), "freqs": (["T", "D2"], "float32")}
    task = make_task(tmp_path, f"p_{style}_{len(ref)}", ref, ins, {"y": (["T", "D"], "float32")},
                     [{"T": 4, "D": 16, "D2": 8}, {"T": 3, "D": 8, "D2": 4}])  # fmt: skip
    sites, rec = _rope_sites(task)
    assert [s.params["style"] for s in sites] == [style]
    # pairs with one cos / sin value each run on the RoPE kernels, complex freqs too (their real and imaginary
    # parts: tests/graph/test_rope_pairs.py)
    assert Impl.family in rec.impls.get(id(sites[0]), set())
    check(task, "library", atol=1e-5, rtol=1e-5)  # the graph's own ops compose and stay correct
