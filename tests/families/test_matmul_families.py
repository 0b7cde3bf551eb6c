"""CPU tests of the GEMM families: interpreted correctness and sm_90a AOT compilation.

TRITON_INTERPRET must be set before Triton is imported; the AOT test switches it off only
while it imports the rendered module, so that @triton.jit builds real JIT functions.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"


import pytest  # noqa: E402
import torch  # noqa: E402
from _aot import aot_compile, check_close, load_source  # noqa: E402

from kernelarc.families import STRATEGIES, families_for, get_family  # noqa: E402
from kernelarc.families import matmul as mm  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

# fp32 arithmetic in the interpreter, one bf16 rounding of the output

# tiny shapes for the interpreter, with edges in every dimension
SHAPES = [(64, 32, 48), (37, 50, 70), (1, 17, 9), (130, 72, 200)]

POINTS = {
    "matmul.tiled": [
        {},
        {"MEMORY": "tma", "GROUP_M": 4, "num_stages": 3},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "SWAP_AB": True, "MEMORY": "tma", "num_warps": 2},
    ],
    "matmul.persistent_tma": [
        {},
        {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        {"EPILOGUE_SUBTILE": 4, "DESCRIPTORS": "device", "GROUP_M": 2, "FLATTEN": True},
        {"BLOCK_M": 128, "BLOCK_N": 128, "WARP_SPECIALIZE": True, "DESCRIPTORS": "device", "NUM_SMS_MULT": 2},
    ],
    "matmul.splitk": [
        {},
        {"SPLIT_K": 4, "BLOCK_K": 16},
        {"SPLIT_K": 8, "REDUCE": "atomic", "SWAP_AB": True, "BLOCK_M": 128, "BLOCK_N": 16, "BLOCK_K": 16},
        {"SPLIT_K": 2, "BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3},
    ],
}


def test_discovered_for_task():
    names = {f.name for f in families_for("matmul")}
    assert {"matmul.tiled", "matmul.persistent_tma", "matmul.splitk"} <= names


@pytest.mark.parametrize("name", sorted(POINTS))
def test_knobs_and_start(name):
    fam = get_family(name)
    assert fam.task == "matmul"
    for knob in fam.knobs:
        assert knob.strategy in STRATEGIES
    start = fam.check_point({})
    assert fam.valid(start)
    # the start is conservative: small tiles, 4 warps, 2 stages
    assert (start["BLOCK_M"], start["BLOCK_N"], start["BLOCK_K"]) == (64, 64, 32)
    assert start["num_warps"] == 4 and start["num_stages"] == 2
    for point in POINTS[name]:
        assert fam.valid(fam.check_point(point)), point
    # rendering is deterministic
    assert fam.render(start) == fam.render(dict(start))


def test_space_contains_known_good_hopper_points():
    good = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8}
    for name in ("matmul.tiled", "matmul.splitk"):
        fam = get_family(name)
        for stages in (3, 4):
            assert fam.valid(fam.check_point({**good, "num_stages": stages})), (name, stages)
    pers = get_family("matmul.persistent_tma")
    assert pers.valid(pers.check_point({**good, "num_stages": 3}))
    assert pers.valid(pers.check_point({**good, "num_stages": 4, "EPILOGUE_SUBTILE": 2}))
    # warp-specialized forms that Triton 3.6 lowers on sm_90a
    assert pers.valid(
        pers.check_point({**good, "num_warps": 4, "num_stages": 3, "WARP_SPECIALIZE": True, "DESCRIPTORS": "device"})
    )
    assert pers.valid(
        pers.check_point(
            {**good, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "WARP_SPECIALIZE": True}
        )
    )
    # ... and forms it crashes on or ignores
    assert not pers.valid(pers.check_point({**good, "num_warps": 4, "num_stages": 3, "WARP_SPECIALIZE": True}))
    assert not pers.valid(pers.check_point({**good, "num_stages": 3, "WARP_SPECIALIZE": True}))


def test_valid_prunes_resource_failures():
    tiled = get_family("matmul.tiled")
    # 6 x (256x128 + 256x128) bf16 tiles = 768 KB of shared memory
    assert not tiled.valid(tiled.check_point({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 128, "num_stages": 6}))
    # 128x256 fp32 accumulator over 4 warps = 256 registers per thread: spills
    assert not tiled.valid(tiled.check_point({"BLOCK_M": 128, "BLOCK_N": 256, "num_warps": 4}))
    # 16 warps cap a thread at 128 registers: ptxas refuses 256x256
    assert not tiled.valid(tiled.check_point({"BLOCK_M": 256, "BLOCK_N": 256, "BLOCK_K": 16, "num_warps": 16}))
    pers = get_family("matmul.persistent_tma")
    # the TMA-store box must be at least 16 bytes wide
    assert not pers.valid(pers.check_point({"BLOCK_N": 16, "EPILOGUE_SUBTILE": 4}))


@pytest.mark.parametrize("name", sorted(POINTS))
def test_interpreted_correctness(name, tmp_path):
    fam = get_family(name)
    gen = torch.Generator().manual_seed(1234)
    for point in POINTS[name]:
        module = load_source(fam.render(fam.check_point(point)), tmp_path)
        for M, N, K in SHAPES:
            A = torch.randn(M, K, generator=gen).to(torch.bfloat16)
            B = torch.randn(N, K, generator=gen).to(torch.bfloat16)
            C = module.run(A, B)
            try:
                check_close(C, A.double() @ B.double().T)
            except AssertionError as e:
                raise AssertionError(f"{name} {point} shape {(M, N, K)}: {e}") from None


def test_degenerate_shape_one(tmp_path):
    for name in POINTS:
        fam = get_family(name)
        module = load_source(fam.render(fam.start), tmp_path)
        A = torch.randn(1, 1).to(torch.bfloat16) + 2
        B = torch.randn(1, 1).to(torch.bfloat16) - 2
        check_close(module.run(A, B), A.double() @ B.double().T)


@pytest.fixture(scope="module")
def aot_start_points(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("aot")
    items = [
        (name, get_family(name).render(get_family(name).start), mm._aot_jobs(name, get_family(name).start))
        for name in sorted(POINTS)
    ]
    return aot_compile(items, tmp)


@pytest.mark.parametrize("name", sorted(POINTS))
def test_aot_compiles_for_sm90a_with_wgmma(name, aot_start_points):
    results = aot_start_points[name]
    assert results, name
    for res in results:
        assert "error" not in res, res.get("error")
        assert res["sm90a"]
        if res["kernel"] == "matmul_kernel":
            assert res["wgmma"], f"{name}: no wgmma in the start point's PTX"
        if name == "matmul.persistent_tma":
            assert res["tma"], "persistent_tma start point does not use TMA"
        assert res["shared"] <= mm.SMEM_LIMIT
