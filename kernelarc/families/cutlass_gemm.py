"""CUTLASS 3.x Hopper GEMM family for the ``matmul`` task (language ``cutlass``).

The C++ lives in ``templates/cutlass/gemm_sm90.cu.in``: TMA operand loads, wgmma, a
warp-specialized persistent mainloop (cooperative: two consumer warpgroups share a tile;
ping-pong: they alternate tiles so one's epilogue overlaps the other's mainloop),
thread-block clusters with TMA multicast, and a persistent or stream-K tile scheduler
with raster order and swizzle. The rendered candidate embeds the C++ and builds it
through :mod:`kernelarc.cutlass` (nvcc, sm_90a, cached by source hash) when imported.

Feasibility (``valid``): accumulator registers per consumer thread (cooperative splits the
tile's rows over two warpgroups, ping-pong gives each warpgroup a whole tile) stay at or
under 128 fp32; at least two pipeline stages of A and B tiles fit shared memory next to
the epilogue's staging; cooperative tiles need at least 128 rows; stream-K needs the
cooperative schedule (seen on the H200: ping-pong + stream-K fails to build). This family is only
offered where nvcc and the CUTLASS headers exist (see ``available``).
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kernelarc.families.base import SM90_SMEM_PER_BLOCK, Family, Knob, cutlass_candidate_head, offered_on_gpu

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "cutlass" / "gemm_sm90.cu.in"
SMEM_LIMIT = SM90_SMEM_PER_BLOCK
ELEM = 2  # bf16

_SCHEDULES = {  # knob value -> (mainloop kernel schedule, epilogue schedule)
    "cooperative": (
        "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
        "cutlass::epilogue::TmaWarpSpecializedCooperative",
    ),
    "pingpong": ("cutlass::gemm::KernelTmaWarpSpecializedPingpong", "cutlass::epilogue::TmaWarpSpecialized"),
}
_SCHEDULERS = {"persistent": "cutlass::gemm::PersistentScheduler", "stream_k": "cutlass::gemm::StreamKScheduler"}
_RASTER = "cutlass::gemm::kernel::detail::RasterOrderOptions::"
_RASTERS = {"heuristic": _RASTER + "Heuristic", "along_m": _RASTER + "AlongM", "along_n": _RASTER + "AlongN"}


def _stages_expr(stages: int) -> str:
    if stages == 0:  # as many as fit next to the epilogue's shared storage
        return (
            "cutlass::gemm::collective::StageCountAutoCarveout<"
            "static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>"
        )
    return f"cutlass::gemm::collective::StageCount<{stages}>"


def gemm_cpp(template: Path, schedules: Mapping[str, tuple[str, str]], k: Mapping[str, Any],
             stages: Callable[[int], str] = _stages_expr) -> str:  # fmt: skip
    """A Hopper GEMM template's C++ for knob point ``k``; ``schedules`` maps the SCHEDULE knob to the
    (mainloop kernel, epilogue) schedules, the one thing the bf16 and fp8 blockwise kernels name differently;
    ``stages``, the STAGES knob's C++ (the fp8 blockwise builder takes only an automatic count)."""
    kernel_schedule, epilogue_schedule = schedules[k["SCHEDULE"]]
    return string.Template(template.read_text()).substitute(
        TILE_M=k["BLOCK_M"],
        TILE_N=k["BLOCK_N"],
        TILE_K=k["BLOCK_K"],
        CLUSTER_M=k["CLUSTER_M"],
        CLUSTER_N=k["CLUSTER_N"],
        KERNEL_SCHEDULE=kernel_schedule,
        EPILOGUE_SCHEDULE=epilogue_schedule,
        STAGES=stages(k["STAGES"]),
        STAGES_N=int(k["STAGES"]),
        TILE_SCHEDULER=_SCHEDULERS[k["TILE_SCHEDULER"]],
        SWIZZLE=k["SWIZZLE"],
        RASTER=_RASTERS[k["RASTER"]],
    )


def render_cpp(k: Mapping[str, Any]) -> str:
    return gemm_cpp(TEMPLATE, _SCHEDULES, k)


def render(knobs: Mapping[str, Any]) -> str:
    k = CUTLASS_GEMM.check_point(knobs)
    return (
        cutlass_candidate_head(CUTLASS_GEMM.name, k, render_cpp(k))
        + '''

def _aligned(A, B):
    """TMA moves 16-byte rows from 16-byte aligned addresses: zero-pad K (and N) to multiples of 8
    when they are not (zeros add nothing to the dot products; padded columns of C are dropped)."""
    M, K = A.shape
    N = B.shape[0]
    Kp, Np = -(-K // 8) * 8, -(-N // 8) * 8
    if (Kp, Np) == (K, N) and A.data_ptr() % 16 == 0 and B.data_ptr() % 16 == 0:
        return A, B
    Ap = A.new_zeros((M, Kp))
    Ap[:, :K] = A
    Bp = B.new_zeros((Np, Kp))
    Bp[:N, :K] = B
    return Ap, Bp


def run(A, B):
    # C[M, N] = A[M, K] @ B[N, K]^T in bf16 with fp32 accumulation
    if A.dtype != torch.bfloat16 or B.dtype != torch.bfloat16:
        raise ValueError("this CUTLASS GEMM takes bf16 operands")
    A = A.contiguous()
    B = B.contiguous()
    M, K = A.shape
    N = B.shape[0]
    C = torch.empty((M, N), device=A.device, dtype=A.dtype)
    if M == 0 or N == 0:
        return C
    if K == 0:
        return C.zero_()
    A, B = _aligned(A, B)
    Np, Kp = B.shape
    if Np == N:
        _KERNEL([A, B], [C], [M, N, Kp])
        return C
    Cp = torch.empty((M, Np), device=A.device, dtype=A.dtype)
    _KERNEL([A, B], [Cp], [M, Np, Kp])
    return Cp[:, :N].contiguous()
'''
    )


def _accumulator_regs(k: Mapping[str, Any]) -> float:
    threads = 256 if k["SCHEDULE"] == "cooperative" else 128  # consumer threads holding one tile's accumulator
    return k["BLOCK_M"] * k["BLOCK_N"] / threads


def valid(k: Mapping[str, Any]) -> bool:
    if k["SCHEDULE"] == "cooperative" and k["BLOCK_M"] < 128:
        return False
    if _accumulator_regs(k) > 128:
        return False
    if k["TILE_SCHEDULER"] == "stream_k" and (k["SCHEDULE"] != "cooperative" or k["CLUSTER_M"] * k["CLUSTER_N"] > 2):
        return False  # CUTLASS's stream-K scheduler pairs with the cooperative kernel only (nvcc fails otherwise)
    stage = (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * ELEM
    epilogue = 2 * 64 * 32 * 4  # EpilogueTileAuto stages small sub-tiles; generous bound
    stages = k["STAGES"] or 2
    return stage * stages + epilogue <= SMEM_LIMIT


def available() -> bool:
    from kernelarc import cutlass

    return cutlass.available()


CUTLASS_GEMM = Family(
    name="matmul.cutlass_sm90",
    dtypes=("bfloat16",),  # run() raises on anything else: an fp16 problem's slot would be spent on the error
    task="matmul",
    description="CUTLASS 3.x Hopper GEMM: TMA + wgmma, warp-specialized cooperative/ping-pong, clusters, stream-K",
    knobs=(
        Knob("BLOCK_M", (64, 128, 256), "tiling", "rows of C per CTA tile"),
        Knob("BLOCK_N", (64, 128, 192, 256), "tiling", "columns of C per CTA tile"),
        Knob("BLOCK_K", (32, 64, 128), "tiling", "depth of one mainloop step"),
        Knob("CLUSTER_M", (1, 2), "scheduling", "CTAs per cluster along M (B tiles multicast over TMA)"),
        Knob("CLUSTER_N", (1, 2), "scheduling", "CTAs per cluster along N (A tiles multicast over TMA)"),
        Knob("SCHEDULE", ("cooperative", "pingpong"), "scheduling", "consumer warpgroups share a tile or alternate"),
        # 0 ("as many as shared memory holds") sits after 7: it is the deepest pipeline that fits, so a
        # too-deep point is one step from it (the search's moves and repairs go by value order)
        Knob("STAGES", (2, 3, 4, 5, 6, 7, 0), "scheduling", "pipeline stages (0: as many as shared memory holds)"),
        Knob("TILE_SCHEDULER", ("persistent", "stream_k"), "algorithmic", "persistent tiles, or stream-K K splits"),
        Knob("RASTER", ("heuristic", "along_m", "along_n"), "memory", "order in which CTAs walk output tiles"),
        Knob("SWIZZLE", (1, 2, 4, 8), "memory", "tile-order swizzle width (L2 reuse)"),
    ),
    start={
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 64,
        "CLUSTER_M": 1,
        "CLUSTER_N": 1,
        "SCHEDULE": "cooperative",
        "STAGES": 0,
        "TILE_SCHEDULER": "persistent",
        "RASTER": "heuristic",
        "SWIZZLE": 1,
    },
    render=render,
    valid=valid,
    language="cutlass",
)


FAMILIES = [CUTLASS_GEMM] if offered_on_gpu(available) else []
