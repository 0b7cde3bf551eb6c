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


def _f64_pairs(x, cos, sin):
    """float64 interleaved rotation with per-pair cos / sin broadcastable to x[..., ::2]."""
    xd = x.double()
    xe, xo = xd[..., 0::2], xd[..., 1::2]
    c, s = cos.double(), sin.double()
    return torch.stack((xe * c - xo * s, xe * s + xo * c), dim=-1).flatten(-2)


def _site(task):
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    (site,) = [s for s in rec.sites[0] if s.kind is Kind.rope]
    assert site.params["style"] == "interleaved" and Impl.family in rec.impls[id(site)]
    return site


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
