"""Interleaved RoPE (pairs x[2i], x[2i + 1] rotated) on the RoPE family kernels, rewritten to index
pairs (``patch_rope_interleaved``), interpreted Triton on the CPU, checked against float64."""

from __future__ import annotations

import pytest
import torch
from _problems import make_task
from test_rope_glu import kernel_calls

from kernelarc.families import all_families, families_for
from kernelarc.families.composed import recognise
from kernelarc.graph.adapters import AdapterError, Impl, patch_rope_interleaved
from kernelarc.graph.patterns import Kind
from kernelarc.tasks.inputs import load_module, make_inputs

# Meta's form on [B, S, H, D] with cos / sin [S, D/2] broadcast over heads, bf16 in, fp32 maths
STACK_BSHD = """
import torch

@torch.no_grad()
def run(x, cos, sin):
    xf = x.float()
    xe, xo = xf[..., 0::2], xf[..., 1::2]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((xe * c - xo * s, xe * s + xo * c), dim=-1).flatten(-2).to(x.dtype)
"""

# GPT-J's rotate_every_two with full-width cos / sin built by repeat_interleave from positions
EVERY_TWO = """
import torch

@torch.no_grad()
def run(x, pos, inv_freq):
    f = pos.float()[:, None] * inv_freq[None, :]
    cos = f.cos().repeat_interleave(2, dim=-1)[None, :, None, :]
    sin = f.sin().repeat_interleave(2, dim=-1)[None, :, None, :]
    rot = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
    return x * cos + rot * sin
"""


# Meta's Llama form: x as complex pairs times complex freqs_cis, built here from cos / sin inputs
COMPLEX_BSHD = """
import torch

@torch.no_grad()
def run(xq, xk, freqs_cos, freqs_sin):
    freqs_cis = torch.complex(freqs_cos, freqs_sin)[None, :, None, :]
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    qo, ko = torch.view_as_real(q * freqs_cis).flatten(3), torch.view_as_real(k * freqs_cis).flatten(3)
    return qo.type_as(xq), ko.type_as(xk)
"""

# the same rotation flattened past the head dim ([B, S, H * D]): not x's layout, left on the graph's ops
COMPLEX_FLAT = """
import torch

@torch.no_grad()
def run(x, freqs_cos, freqs_sin):
    f = torch.complex(freqs_cos, freqs_sin)[None, :, None, :]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * f).flatten(2)
"""

# complex128 (x in float64): the kernels' fp32 maths would lose its precision, so it stays on the graph's ops
COMPLEX_F64 = """
import torch

@torch.no_grad()
def run(x, freqs_cos, freqs_sin):
    f = torch.complex(freqs_cos, freqs_sin)[None, :, None, :]
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * f).flatten(3)
"""


# a real multiplier: no imaginary part for the kernels' sin
COMPLEX_REAL_SCALE = """
import torch

@torch.no_grad()
def run(x, freqs_cos, freqs_sin):
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cos[None, :, None, :]).flatten(3)
"""

# the cast after the reshape: the site's x would be the bf16 tensor, the kernels' output rounded to bf16
COMPLEX_CAST_AFTER = """
import torch

@torch.no_grad()
def run(x, freqs_cos, freqs_sin):
    f = torch.complex(freqs_cos, freqs_sin)[None, :, None, :]
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).float())
    return torch.view_as_real(xc * f).flatten(3)
"""

# complex128 freqs times complex64 pairs: a complex128 product
COMPLEX_F64_FREQS = """
import torch

@torch.no_grad()
def run(x, freqs_cos, freqs_sin):
    f = torch.complex(freqs_cos.double(), freqs_sin.double())[None, :, None, :]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * f).flatten(3)
"""


def _f64_pairs(x, cos, sin):
    """float64 interleaved rotation with per-pair cos / sin broadcastable to x[..., ::2]."""
    xd = x.double()
    xe, xo = xd[..., 0::2], xd[..., 1::2]
    c, s = cos.double(), sin.double()
    return torch.stack((xe * c - xo * s, xe * s + xo * c), dim=-1).flatten(-2)


def _site(task, style="interleaved"):
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    (site,) = [s for s in rec.sites[0] if s.kind is Kind.rope][:1]
    assert site.params["style"] == style and Impl.family in rec.impls[id(site)]
    return site


def _complex_task(tmp_path, name, ref, ins, dtype="bfloat16"):
    return make_task(
        tmp_path, name, ref,
        {**{k: (["B", "S", "H", "D"], dtype) for k in ins},
         "freqs_cos": (["S", "D2"], "float32"), "freqs_sin": (["S", "D2"], "float32")},
        {f"{k}_out": (["B", "S", "H", "D"], dtype) for k in ins},
        [{"B": 2, "S": 5, "H": 3, "D": 16, "D2": 8}, {"B": 1, "S": 4, "H": 2, "D": 12, "D2": 6}],
    )  # fmt: skip


@pytest.mark.parametrize(("suffix", "halves"), [("rope.separate", "split"), ("rope.fused_qk", "join")])
def test_complex_freqs_form_on_the_rope_kernels(tmp_path, suffix, halves):
    """view_as_complex(x pairs) * freqs_cis: cos / sin are freqs_cis's real and imaginary parts, one per pair."""
    task = _complex_task(tmp_path, "p_rope_complex", COMPLEX_BSHD, ("xq", "xk"))
    assert _site(task, "interleaved_complex").params["half_width"]
    assert kernel_calls(task, suffix, {"halves": halves}) == 4  # q and k, two workloads
    fam = next(f for f in families_for(task) if f.name.endswith(suffix))
    mod = load_module(fam.render(fam.check_point({"halves": halves})), f"complex_{suffix}")
    for i in (0, 1):
        xq, xk, c, s = make_inputs(task, i, 5, "cpu")
        got = mod.run(xq, xk, c, s)
        for x, y in zip((xq, xk), got, strict=True):
            assert y.dtype == torch.bfloat16 and y.shape == x.shape
            torch.testing.assert_close(y.double(), _f64_pairs(x, c[None, :, None, :], s[None, :, None, :]),
                                       atol=2e-2, rtol=2e-2)  # fmt: skip


@pytest.mark.parametrize("ref", [COMPLEX_FLAT, COMPLEX_F64, COMPLEX_REAL_SCALE, COMPLEX_CAST_AFTER, COMPLEX_F64_FREQS])
def test_complex_freqs_the_kernels_cannot_serve_stay_on_the_graphs_ops(tmp_path, ref):
    dtype = "float64" if ref is COMPLEX_F64 else "bfloat16"
    out = "float64" if ref in (COMPLEX_F64, COMPLEX_F64_FREQS) else "float32"
    outs = {"y": (["B", "S", "HD"], "float32")} if ref is COMPLEX_FLAT else {"y": (["B", "S", "H", "D"], out)}
    task = make_task(
        tmp_path, f"p_rope_complex_{len(ref)}", ref,
        {"x": (["B", "S", "H", "D"], dtype), "freqs_cos": (["S", "D2"], "float32"),
         "freqs_sin": (["S", "D2"], "float32")},
        outs, [{"B": 2, "S": 5, "H": 3, "D": 16, "D2": 8, **({"HD": 48} if ref is COMPLEX_FLAT else {})}],
    )  # fmt: skip
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    assert not [s for s in rec.sites[0] if s.kind is Kind.rope]


@pytest.mark.parametrize(("suffix", "halves"), [("rope.separate", "split"), ("rope.fused_qk", "join")])
def test_interleaved_stack_form_on_the_rope_kernels(tmp_path, suffix, halves):
    task = make_task(
        tmp_path, "p_rope_pairs", STACK_BSHD,
        {"x": (["B", "S", "H", "D"], "bfloat16"), "cos": (["S", "D2"], "float32"), "sin": (["S", "D2"], "float32")},
        {"y": (["B", "S", "H", "D"], "bfloat16")},
        [{"B": 2, "S": 5, "H": 3, "D": 16, "D2": 8}, {"B": 1, "S": 4, "H": 2, "D": 12, "D2": 6}],
    )  # fmt: skip
    assert _site(task).params["half_width"]
    assert kernel_calls(task, suffix, {"halves": halves}) == 2
    fam = next(f for f in families_for(task) if f.name.endswith(suffix))
    mod = load_module(fam.render(fam.check_point({"halves": halves})), f"pairs_{suffix}")
    for i in (0, 1):
        x, cos, sin = make_inputs(task, i, 4, "cpu")
        want = _f64_pairs(x, cos[:, None, :], sin[:, None, :])
        got = mod.run(x, cos, sin)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), want, atol=2e-2, rtol=2e-2)


def test_rotate_every_two_with_repeated_cos_on_the_rope_kernel(tmp_path):
    task = make_task(
        tmp_path, "p_rope_every_two", EVERY_TWO,
        {"x": (["B", "S", "H", "D"], "float32"), "pos": (["S"], "int64"), "inv_freq": (["D2"], "float32")},
        {"y": (["B", "S", "H", "D"], "float32")},
        [{"B": 2, "S": 6, "H": 2, "D": 8, "D2": 4}],
    )  # fmt: skip
    site = _site(task)
    assert not site.params["half_width"] and site.params["dup_pairs"]
    assert kernel_calls(task, "rope.separate") == 1
    fam = next(f for f in families_for(task) if f.name.endswith("rope.separate"))
    mod = load_module(fam.render(fam.start), "pairs_every_two")
    x, pos, inv_freq = make_inputs(task, 0, 2, "cpu")
    f = pos.double()[:, None] * inv_freq.double()[None, :]
    want = _f64_pairs(x, f.cos()[None, :, None, :], f.sin()[None, :, None, :])
    # fp32 cos / sin of the positions (the graph's own) against float64 ones: 1e-4
    torch.testing.assert_close(mod.run(x, pos, inv_freq).double(), want, atol=1e-4, rtol=1e-4)


def test_interleave_rewrite_applies_at_every_knob_value_and_refuses_foreign_source():
    for name in ("rope.fused_qk", "rope.separate"):
        fam = all_families()[name]
        for k in fam.knobs:
            for v in k.values:
                src = patch_rope_interleaved(fam.render({**fam.start, k.name: v}))
                assert "2 * d[None, None, :]" in src and "+ HALF" not in src
    with pytest.raises(AdapterError):
        patch_rope_interleaved("def run(q, k, cos, sin):\n    return q, k\n")
