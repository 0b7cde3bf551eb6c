"""Depthwise conv1d sites (``kernelarc.graph.dwconv``): the convolution recognised with its time window, channel
slices and the pointwise ops after them, the generated kernel checked against the reference on the CPU (Triton's
interpreter) in fp32 and bf16 and on the padding forms, what is not a depthwise convolution left alone, and the
kernel compiled for sm_90a without a GPU."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch
from _problems import make_task, spied_family_module
from shared_dirs import SKIP_REASON, shared_path

from kernelarc.families import families_for
from kernelarc.families.composed import DWCONV_KERNEL, recognise, start_points
from kernelarc.graph.dwconv import render_dwconv
from kernelarc.graph.patterns import Kind
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

SOL = shared_path("sol-execbench")
needs_sol = pytest.mark.skipif(not SOL.is_dir(), reason=f"sol-execbench {SKIP_REASON}")

# Hyena's short filter: pad 2, trim to the input's length, three slices, a gate
HYENA = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    L = u.shape[-1]
    uc = F.conv1d(u, w, bias=b, padding=2, groups=u.shape[1])[..., :L]
    x0, x1, v = uc[:, :4], uc[:, 4:8], uc[:, 8:12]
    return v * x0, x0, x1
"""

# Mamba's causal conv: pad K - 1, trim, SiLU; the channels split with torch.split into two outputs
MAMBA = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    L = u.shape[-1]
    y = F.silu(F.conv1d(u, w, b, padding=3, groups=12)[..., :L])
    return y
"""

SPLIT = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    y = F.conv1d(u, w, b, padding="same", groups=12, dilation=2)
    a, g = torch.split(y, 6, dim=1)
    return a * torch.sigmoid(g.float()).to(a.dtype), a
"""

# no bias, no padding: the output is shorter than the input
VALID = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w):
    return F.conv1d(u, w, groups=12) * 0.5
"""

# a window starting past the first step and ending before the last (negative end)
WINDOW = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    return torch.tanh(F.conv1d(u, w, b, padding=2, groups=12)[..., 1:-2])
"""

# Mamba's gate: tensors from outside the site (the conv's own input, SiLU of another input, a per-channel vector)
GATED = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b, z, d):
    L = u.shape[-1]
    y = F.silu(F.conv1d(u, w, b, padding=3, groups=12)[..., :L])
    return (y * d.view(1, -1, 1) + u) * F.silu(z) * 0.5
"""

# a product with a value computed from the convolution outside the site (a flip): left to the graph
FLIPPED = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    y = F.conv1d(u, w, b, padding=1, groups=12)
    return torch.sigmoid(y) * torch.flip(y, [-1])
"""

# the input written in place after the convolution: the site would run at its output and read the new values
IN_PLACE = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    y = F.conv1d(u, w, b, padding=1, groups=12)
    u.mul_(2.0)
    return torch.sigmoid(y) * u
"""

# a literal trim (37) in a graph traced for lengths 37, 130 and 5: the window is 37 steps, not the input's length
LITERAL_END = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    return F.conv1d(u, w, b, padding=2, groups=12)[..., :37] * 2
"""

# two channels per group: not depthwise
GROUPED = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    return F.conv1d(u, w, b, padding=1, groups=6)
"""

STRIDED = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(u, w, b):
    return F.conv1d(u, w, b, padding=1, stride=2, groups=12)
"""


def _task(tmp_path: Path, name: str, ref: str, dtype: str, taps: int = 3, wshape=None):
    ins = {"u": (["B", 12, "L"], dtype), "w": (wshape or [12, 1, taps], dtype), "b": ([12], dtype)}
    if "def run(u, w, b, z, d)" in ref:
        ins |= {"z": (["B", 12, "L"], dtype), "d": ([12], dtype)}
    if "def run(u, w)" in ref:
        del ins["b"]
    return make_task(tmp_path, name, ref, ins, {"y": (["B", 12, "L"], dtype)},
                     [{"B": 2, "L": 37}, {"B": 3, "L": 130}, {"B": 1, "L": 5}])  # fmt: skip


def _sites(task):
    return [s for case in recognise(task).sites for s in case if s.kind is Kind.dwconv]


def _check(task, name: str, dtype: str, one_part: bool = True) -> None:
    """The composed candidate against the reference on every workload; ``one_part``: one kernel part serves every
    case (the spy counts its calls: no fallback)."""
    mod, calls = spied_family_module(task, "dwconv.tiled", {"rest": "eager"}, name=name)
    ref = load_module(task.definition.reference, f"ref_{name}")
    for i in range(len(task.workloads)):
        args = make_inputs(task, i, 7, "cpu")
        got, want = mod.run(*args), ref.run(*args)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            top = max(1.0, w.double().abs().max().item())
            # fp32: summation order only; bf16: one rounding step of the largest value
            bound = 1e-5 if dtype == "float32" else 2**-7
            assert (g.double() - w.double()).abs().max().item() <= bound * top, (name, i)
    assert not one_part or len(calls) == len(task.workloads)  # the kernel ran, no fallback


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_hyena_gate_is_one_site_and_matches(tmp_path, dtype):
    task = _task(tmp_path, f"dw_hyena_{dtype}", HYENA, dtype)
    sites = _sites(task)
    assert len(sites) == len(recognise(task).sites)  # one per case, nothing left to the graph
    s = sites[0]
    assert (s.params["channels"], s.params["width"], s.params["slices"], s.params["ops"]) == (12, 4, 3, 1)
    plan = s.params["_plan"]
    assert len(plan.outputs) == 3 and plan.t1 == "L"  # the trim to the traced length: one kernel for all lengths
    fams = families_for(task)
    fam = next(f for f in fams if f.name.endswith(".dwconv.tiled"))
    assert start_points(task, fams)[0][0] is fam  # the kernel family leads
    _check(task, f"dw_hyena_{dtype}", dtype)


@pytest.mark.parametrize(
    ("name", "ref", "taps"), [("mamba", MAMBA, 4), ("split", SPLIT, 3), ("valid", VALID, 5), ("window", WINDOW, 3)]
)
def test_padding_forms_and_epilogues_match(tmp_path, name, ref, taps):
    task = _task(tmp_path, f"dw_{name}", ref, "float32", taps=taps)
    (s, *_) = _sites(task)
    plan = s.params["_plan"]
    if name == "split":
        assert (plan.pad_left, plan.pad_right, plan.dilation, plan.width) == (2, 2, 2, 6)
        assert len(plan.outputs) == 2
    if name == "valid":
        assert not plan.has_bias and plan.pad_left == 0
    if name == "window":
        assert (plan.t0, plan.t1) == (1, -2)
    _check(task, f"dw_{name}", "float32")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_outside_tensors_in_the_gate_are_loaded_by_the_kernel(tmp_path, dtype):
    task = _task(tmp_path, f"dw_gated_{dtype}", GATED, dtype, taps=4)
    (s, *_) = _sites(task)
    plan = s.params["_plan"]
    assert sorted(role for _, role in plan.extras) == ["channel", "full", "full"]
    assert len(plan.outputs) == 1 and len(plan.nodes) >= 5  # silu, the scale, the add, the gate, the half
    _check(task, f"dw_gated_{dtype}", dtype)


def test_a_value_computed_from_the_convolution_stays_outside(tmp_path):
    task = _task(tmp_path, "dw_flip", FLIPPED, "float32")
    (s, *_) = _sites(task)
    plan = s.params["_plan"]
    # the sigmoid joins the site; the product reads the flip of y, so y and the sigmoid are stored for it
    assert plan.extras == [] and [n.name for n in plan.outputs] == [plan.conv.name, "sigmoid"]
    _check(task, "dw_flip", "float32")


def test_an_in_place_write_after_the_convolution_keeps_the_graphs_ops(tmp_path):
    assert _sites(_task(tmp_path, "dw_inplace", IN_PLACE, "float32")) == []


def test_a_literal_trim_is_not_taken_for_the_inputs_length(tmp_path):
    task = _task(tmp_path, "dw_literal", LITERAL_END, "float32")
    # one case per length: the trim is the input's length at 37 only (37 steps of 130 at L=130, all 7 at L=5)
    assert [s.params["_plan"].t1 for s in _sites(task)] == ["L", 37, None]
    _check(task, "dw_literal", "float32", one_part=False)


@pytest.mark.parametrize(("name", "ref", "wshape"), [("grouped", GROUPED, [12, 2, 3]), ("strided", STRIDED, None)])
def test_other_convolutions_are_not_sites(tmp_path, name, ref, wshape):
    task = _task(tmp_path, f"dw_{name}", ref, "float32", wshape=wshape)
    assert _sites(task) == []


def test_inputs_it_does_not_serve_fall_back(tmp_path):
    """Another channel count or dtype than traced, no bias where one was: ``run`` declines (the graph's own ops
    run)."""
    (s, *_) = _hyena_sites(tmp_path)
    mod = load_module(render_dwconv(s.params["_plan"], dict(DWCONV_KERNEL.start), "t"), "dw_decline")
    x, w, b = torch.randn(2, 12, 9), torch.randn(12, 1, 3), torch.randn(12)
    assert mod.run(x, w, b) is not None
    assert mod.run(torch.randn(2, 10, 9), w[:10], b[:10]) is None
    assert mod.run(x.double(), w.double(), b.double()) is None
    assert mod.run(x, w, None) is None


def _hyena_sites(tmp_path: Path):
    return _sites(_task(tmp_path, "dw_hyena_f32", HYENA, "float32"))


def test_tiles_edges_and_a_strided_input(tmp_path):
    """Rows and steps that do not fill a tile, an input read through strides (a transposed view)."""
    (s, *_) = _hyena_sites(tmp_path)
    mod = load_module(render_dwconv(s.params["_plan"], {"BLOCK_R": 8, "BLOCK_L": 16, "NUM_WARPS": 4}, "t"), "dw_edge")
    mod.INTERPRET = False  # the knobs' tiles, not the interpreter's larger ones
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 45, 12, generator=g).transpose(1, 2)  # [3, 12, 45], time not the unit stride
    w, b = torch.randn(12, 1, 3, generator=g), torch.randn(12, generator=g)
    y = torch.nn.functional.conv1d(x.double(), w.double(), b.double(), padding=2, groups=12)[..., :45]
    plan = s.params["_plan"]
    # the outputs in graph order: the slices read outside (x0, x1), then the gate
    wants = [y[:, o : o + 4] if (o := plan.slices.get(n)) is not None else y[:, 8:12] * y[:, :4] for n in plan.outputs]
    assert [n in plan.slices for n in plan.outputs] == [True, True, False]
    for got, want in zip(mod.run(x, w, b), wants, strict=True):
        assert (got.double() - want).abs().max().item() <= 1e-5 * max(1.0, want.abs().max().item())


def _signature(src: str, dt: str) -> dict[str, str]:
    """The kernel's Triton signature read from its rendered parameters: pointers (``*_ptr``, outputs ``o<i>``, outside
    tensors ``e<i>``) of ``dt``, ints, the tile constexprs."""
    params = re.search(r"def _dwconv_kernel\(([^)]*)\)", src).group(1).split(", ")
    sig = {}
    for prm in params:
        name = prm.split(":")[0]
        sig[name] = "constexpr" if "constexpr" in prm else (f"*{dt}" if re.fullmatch(r"\w+_ptr|o\d+|e\d+", name)
                                                           else "i32")  # fmt: skip
    return sig


def test_the_kernel_compiles_for_sm90a(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
    from _aot import aot_compile

    plans = {"hyena": _hyena_sites(tmp_path)[0].params["_plan"]}
    for dtype, dt in (("float32", "fp32"), ("bfloat16", "bf16")):
        gated = _sites(_task(tmp_path, f"dw_gated_aot_{dtype}", GATED, dtype, taps=4))[0].params["_plan"]
        plans[f"gated_{dt}"] = gated
    d16 = [["tt.divisibility", 16]]
    items = []
    for label, plan in plans.items():
        dt = "bf16" if label.endswith("bf16") else "fp32"
        for k in (DWCONV_KERNEL.start, {"BLOCK_R": 8, "BLOCK_L": 1024, "NUM_WARPS": 8}):
            src = render_dwconv(plan, dict(k), "t")
            sig = _signature(src, dt)
            sig.update({"sxt": "constexpr", "sb": "constexpr"})
            consts = {"BLOCK_R": k["BLOCK_R"], "BLOCK_L": k["BLOCK_L"], "sxt": 1, "sb": 1}
            names = list(sig)
            attrs = {(names.index(n),): d16 for n in names if sig[n].startswith("*") or n in ("sxb", "sxc")}
            jobs = [dict(kernel="_dwconv_kernel", signature=sig, constexprs=consts, attrs=attrs,
                         options={"num_warps": k["NUM_WARPS"]})]  # fmt: skip
            items.append((f"dw_{label}_{k['BLOCK_L']}", src, jobs))
    results = aot_compile(items, tmp_path)
    assert len(results) == 6
    for label, res in results.items():
        for r in res:
            assert "error" not in r, (label, r.get("error"))
            assert r["sm90a"], label


@needs_sol
def test_sol_execbench_hyena_conv_is_recognised_and_leads():
    task = load_task(SOL / "L1/006_hyena_depthwise_conv1d_split_gate", cpu=True)
    sites = _sites(task)
    assert sites and all(s.params["slices"] == 3 and s.params["width"] == 256 for s in sites)
    fams = families_for(task)
    first = start_points(task, fams)[0]
    assert first[0].name.endswith(".dwconv.tiled") and first[1]["rest"] == "eager"
    mod, calls = spied_family_module(task, "dwconv.tiled", {"rest": "eager"}, name="dw_sol")
    ref = load_module(task.definition.reference, "ref_dw_sol")
    args = make_inputs(task, 0, 1, "cpu")
    for got, want in zip(mod.run(*args), ref.run(*args), strict=True):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= 1e-5 + 1e-5 * want.abs().max().item()
    assert calls == [1]
