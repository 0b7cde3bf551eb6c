"""CPU tests of the FlashAttention families: interpreted correctness and sm_90a AOT.

TRITON_INTERPRET must be set before Triton is imported; the AOT test switches it off only
while it imports the rendered module, so that @triton.jit builds real JIT functions.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"

import math  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from _aot import aot_compile, check_close, load_source  # noqa: E402

from kernelarc.families import STRATEGIES, families_for, get_family  # noqa: E402
from kernelarc.families import _attn_common as ac  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


# (B, H, Hkv, S, D): the task's CPU shapes plus GQA and odd lengths
SHAPES = [(1, 2, 1, 32, 16), (1, 2, 1, 40, 16), (2, 4, 2, 37, 32)]

POINTS = [
    {},
    {"MEMORY": "tma", "SCALE": "q", "M_ORDER": "reverse", "GRID_ORDER": "heads_fastest", "BLOCK_N": 32},
    {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "MEMORY": "tma"},
    {"BLOCK_M": 16, "BLOCK_N": 16, "LOOP": "single", "num_warps": 2, "num_stages": 3, "MEMORY": "tma"},
]
# fastest measured on the H200 for D=128 (NOTES_compute.md)
STRONG_POINT = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "MEMORY": "tma"}
RESIDUAL_POINTS = [{}, {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "MEMORY": "tma", "LOOP": "single"}]

FAMILIES = {"attention.flash": POINTS, "attention_residual.flash": RESIDUAL_POINTS}


def reference(q, k, v, causal):
    B, H, S, D = q.shape
    group = H // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(D)
    if causal:
        s = s.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v


def test_discovered_for_tasks():
    assert "attention.flash" in {f.name for f in families_for("attention")}
    assert "attention_residual.flash" in {f.name for f in families_for("attention_residual")}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_knobs_and_start(name):
    fam = get_family(name)
    for knob in fam.knobs:
        assert knob.strategy in STRATEGIES
    start = fam.check_point({})
    assert fam.valid(start)
    assert (start["BLOCK_M"], start["BLOCK_N"], start["num_warps"], start["num_stages"]) == (64, 64, 4, 2)
    for point in FAMILIES[name]:
        assert fam.valid(fam.check_point(point)), point
    # known-good Hopper points are in the space and valid
    for bn in (64, 128):
        assert fam.valid(fam.check_point({"BLOCK_M": 128, "BLOCK_N": bn, "num_warps": 8, "num_stages": 2}))
    assert fam.valid(fam.check_point({"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "MEMORY": "tma"}))
    assert fam.valid(fam.check_point(STRONG_POINT))


def test_valid_prunes_resource_failures():
    fam = get_family("attention.flash")
    # q + 2 x 4 stages x 256x128 K/V tiles: > 227 KB
    assert not fam.valid(fam.check_point({"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4}))
    # 128x128 scores + 128x128 accumulator over 4 warps: spills
    assert not fam.valid(fam.check_point({"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}))


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_interpreted_correctness(name, tmp_path):
    fam = get_family(name)
    residual = fam.task == "attention_residual"
    gen = torch.Generator().manual_seed(4321)
    for point in FAMILIES[name]:
        module = load_source(fam.render(fam.check_point(point)), tmp_path)
        for B, H, HKV, S, D in SHAPES:
            for causal in (0, 1):
                q = torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16)
                k = torch.randn(B, HKV, S, D, generator=gen).to(torch.bfloat16)
                v = torch.randn(B, HKV, S, D, generator=gen).to(torch.bfloat16)
                ref = reference(q, k, v, causal)
                if residual:
                    r = torch.randn(B, H, S, D, generator=gen).to(torch.bfloat16)
                    out = module.run(q, k, v, r, causal)
                    ref = ref + r.double()
                else:
                    out = module.run(q, k, v, causal)
                try:
                    check_close(out, ref)
                except AssertionError as e:
                    raise AssertionError(f"{name} {point} shape {(B, H, HKV, S, D)} causal={causal}: {e}") from None


@pytest.fixture(scope="module")
def aot_points(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aot")
    items = []
    for name in sorted(FAMILIES):
        fam = get_family(name)
        residual = fam.task == "attention_residual"
        items.append(
            (name, fam.render(fam.start), ac.aot_jobs(fam, fam.start, head_dim=128, causal=True, residual=residual))
        )
    fam = get_family("attention.flash")
    point = fam.check_point(STRONG_POINT)
    items.append(("strong", fam.render(point), ac.aot_jobs(fam, point, head_dim=128, causal=False)))
    # the scale as Inductor passes a Python float from a compiled graph (composed rests with trace_kernels): fp64
    jobs = ac.aot_jobs(fam, fam.start, head_dim=128, causal=True)
    for job in jobs:
        job["signature"] = {**job["signature"], "qk_scale": "fp64"}
    items.append(("fp64_scale", fam.render(fam.start), jobs))
    return aot_compile(items, tmp)


@pytest.mark.parametrize("name", [*sorted(FAMILIES), "fp64_scale"])
def test_aot_compiles_for_sm90a_with_wgmma(name, aot_points):
    (res,) = aot_points[name]
    assert "error" not in res, res.get("error")
    assert res["sm90a"]
    assert res["wgmma"], f"{name}: no wgmma in the start point's PTX"
    assert res["shared"] <= ac.SMEM_LIMIT


def test_aot_fastest_measured_point(aot_points):
    """The point that measured fastest on the H200 (NOTES_compute.md) compiles to wgmma + TMA
    within the shared-memory limit."""
    (res,) = aot_points["strong"]
    assert "error" not in res, res.get("error")
    assert res["wgmma"] and res["tma"]
    assert res["shared"] <= ac.SMEM_LIMIT
