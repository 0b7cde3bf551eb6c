"""CUTLASS 3.x Hopper fp8 GEMM family with blockwise scales for the ``fp8_matmul`` task (language
``cutlass``).

The C++ is ``templates/cutlass/gemm_fp8_sm90.cu.in``: CUTLASS's FP8 blockwise-scaled mainloop
(``KernelTmaWarpSpecialized{Cooperative,Pingpong}FP8Blockwise``, example 67 with scale granularity
1 x 128 x 128): A, B and their scales arrive by TMA, each 128-deep K block's wgmma sum is promoted into
the fp32 accumulator times its scales, warp-specialized consumers, clusters with TMA multicast, a
persistent or stream-K tile scheduler. The same task as ``fp8_matmul.tiled`` (scales
``scale_a`` [M, K/128] and ``scale_b`` [N/128, K/128]); the launcher hands CUTLASS ``scale_a``
transposed (M-major: the mainloop loads a tile's row scales by TMA), pads N and K to multiples of 128
with zeros (the scale blocks do not change) and M to a multiple of 4 (16-byte scale rows).

Feasibility (``valid``): the mainloop keeps two fp32 register tiles per consumer thread (the
accumulator and the K block's wgmma sum), at most 128 + 128 under the consumers' register budget:
cooperative tiles (two warpgroups on one tile) of at most 128 x 128, ping-pong tiles (one warpgroup
per tile) of at most 64 x 128; a tile's columns must hold whole 128-wide scale blocks (BLOCK_N is
128 or 256) and its K step is one scale block (BLOCK_K = 128); two or more pipeline stages fit
shared memory next to the epilogue. Only offered where nvcc and the CUTLASS headers exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kernelarc.cutlass import available
from kernelarc.families.base import SM90_SMEM_PER_BLOCK, Family, Knob, cutlass_candidate_head, offered_on_gpu
from kernelarc.families.cutlass_gemm import _stages_expr, gemm_cpp

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "cutlass" / "gemm_fp8_sm90.cu.in"
SCALE_BLOCK = 128

_SCHEDULES = {  # knob value -> (mainloop kernel schedule, epilogue schedule)
    "cooperative": (
        "cutlass::gemm::KernelTmaWarpSpecializedCooperativeFP8Blockwise",
        "cutlass::epilogue::TmaWarpSpecializedCooperative",
    ),
    "pingpong": (
        "cutlass::gemm::KernelTmaWarpSpecializedPingpongFP8Blockwise",
        "cutlass::epilogue::TmaWarpSpecialized",
    ),
}


def _stages(n: int) -> str:
    """The STAGES knob's C++: CUTLASS's blockwise-scaled builder takes only an automatic stage count, so N stages
    are the automatic count of a carveout that leaves room for N (the template's ``carveout_for_stages``)."""
    if n == 0:
        return _stages_expr(0)
    return f"cutlass::gemm::collective::StageCountAutoCarveout<carveout_for_stages({int(n)})>"


def render_cpp(k: Mapping[str, Any]) -> str:
    return gemm_cpp(TEMPLATE, _SCHEDULES, k, stages=_stages)


_RUN = '''

def _padded(X, rows, cols):
    """X zero-padded to [rows, cols] (a copy only when a dimension grows)."""
    if tuple(X.shape) == (rows, cols):
        return X.contiguous()
    Xp = X.new_zeros((rows, cols))
    Xp[: X.shape[0], : X.shape[1]] = X
    return Xp


def run(A, B, scale_a, scale_b):
    # C[M, N] = (A * scale_a) @ (B * scale_b)^T in bf16; scale_a [M, K/128], scale_b [N/128, K/128]
    if A.dtype != torch.float8_e4m3fn or B.dtype != torch.float8_e4m3fn:
        raise ValueError(f"float8_e4m3fn operands expected, got {A.dtype} and {B.dtype}")
    M, K = A.shape
    N = B.shape[0]
    kb, nb = -(-K // 128), -(-N // 128)
    if tuple(scale_a.shape) != (M, kb) or tuple(scale_b.shape) != (nb, kb):
        raise ValueError(
            f"blockwise scales expected: scale_a ({M}, {kb}) and scale_b ({nb}, {kb}), "
            f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )
    C = torch.empty((M, N), device=A.device, dtype=torch.bfloat16)
    if M == 0 or N == 0:
        return C
    # the mainloop takes whole 128-wide blocks: zero-pad N and K (the scale blocks stay the same); the
    # scales of A come by TMA, M-major, so their rows need 16-byte strides: M padded to a multiple of 4
    Mp, Kp, Np = -(-M // 4) * 4, kb * 128, nb * 128
    A = _padded(A, Mp, Kp)
    B = _padded(B, Np, Kp)
    sfa = _padded(scale_a.to(torch.float32), Mp, kb).t().contiguous()  # [K/128, M]: M-major
    sfb = scale_b.to(torch.float32).contiguous()  # [N/128, K/128]: K-major
    if (Mp, Np) == (M, N):
        _KERNEL([A, B, sfa, sfb], [C], [M, N, Kp])
        return C
    Cp = torch.empty((Mp, Np), device=A.device, dtype=torch.bfloat16)
    _KERNEL([A, B, sfa, sfb], [Cp], [Mp, Np, Kp])
    return Cp[:M, :N].contiguous()
'''


def render(knobs: Mapping[str, Any]) -> str:
    k = CUTLASS_FP8_GEMM.check_point(knobs)
    return cutlass_candidate_head(CUTLASS_FP8_GEMM.name, k, render_cpp(k)) + _RUN


def _regs_per_consumer_thread(k: Mapping[str, Any]) -> float:
    """fp32 registers of the accumulator plus the K block's wgmma sum per consumer thread."""
    threads = 256 if k["SCHEDULE"] == "cooperative" else 128
    return 2 * k["BLOCK_M"] * k["BLOCK_N"] / threads


def smem_bytes(k: Mapping[str, Any]) -> int:
    """Operand stages (e4m3) with their scale slices, as CUTLASS's builder counts a stage (rounded up to 128 bytes,
    and the pipeline's two 8-byte barriers), and a bound on the epilogue's staging."""
    stage = (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] + (k["BLOCK_M"] + k["BLOCK_N"] // SCALE_BLOCK) * 4
    stage = -(-stage // 128) * 128 + 16
    epilogue = 2 * 64 * 32 * 4
    return stage * (k["STAGES"] or 2) + epilogue


def valid(k: Mapping[str, Any]) -> bool:
    if k["SCHEDULE"] == "cooperative" and k["BLOCK_M"] < 128:
        return False  # two consumer warpgroups split the tile's rows: 64 each at least
    if _regs_per_consumer_thread(k) > 128:
        return False
    if k["TILE_SCHEDULER"] == "stream_k" and (k["SCHEDULE"] != "cooperative" or k["CLUSTER_M"] * k["CLUSTER_N"] > 2):
        return False  # as for the bf16 family: stream-K pairs with the cooperative kernel
    return smem_bytes(k) <= SM90_SMEM_PER_BLOCK


CUTLASS_FP8_GEMM = Family(
    name="fp8_matmul.cutlass_sm90",
    task="fp8_matmul",
    description="CUTLASS 3.x Hopper fp8 GEMM, blockwise 1x128 / 128x128 scales promoted per K block, warp-specialized",
    knobs=(
        Knob("BLOCK_M", (64, 128, 256), "tiling", "rows of C per CTA tile"),
        Knob("BLOCK_N", (128, 256), "tiling", "columns of C per CTA tile (whole 128-wide weight-scale blocks)"),
        Knob("BLOCK_K", (128,), "tiling", "depth of one mainloop step: one scale block"),
        Knob("CLUSTER_M", (1, 2), "scheduling", "CTAs per cluster along M (B tiles multicast over TMA)"),
        Knob("CLUSTER_N", (1, 2), "scheduling", "CTAs per cluster along N (A tiles multicast over TMA)"),
        Knob("SCHEDULE", ("cooperative", "pingpong"), "scheduling", "consumer warpgroups share a tile or alternate"),
        Knob("STAGES", (2, 3, 4, 5, 6, 7, 0), "scheduling", "pipeline stages (0: as many as shared memory holds)"),
        Knob("TILE_SCHEDULER", ("persistent", "stream_k"), "algorithmic", "persistent tiles, or stream-K K splits"),
        Knob("RASTER", ("heuristic", "along_m", "along_n"), "memory", "order in which CTAs walk output tiles"),
        Knob("SWIZZLE", (1, 2, 4, 8), "memory", "tile-order swizzle width (L2 reuse)"),
    ),
    # CUTLASS example 67's shape without its cluster: cooperative 128x128x128, as many stages as fit
    start={
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 128,
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


FAMILIES = [CUTLASS_FP8_GEMM] if offered_on_gpu(available) else []
