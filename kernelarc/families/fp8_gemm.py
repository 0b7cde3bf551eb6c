"""fp8 (e4m3) GEMM families for the built-in ``fp8_matmul`` task (Hopper, sm_90a).

Task: ``run(A, B, scale_a, scale_b)`` with A [M, K] and B [N, K] in ``float8_e4m3fn`` (B in
nn.Linear weight layout) and fp32 dequantisation scales returns C = (A * sa) @ (B * sb).T in bf16,
products and sums in fp32. The scaling is read from the scale shapes, as SOL-ExecBench's Quant
problems and ``torch._scaled_mm`` define it:

* blockwise (the Quant problems' recipe, and the task's): ``scale_a`` [M, ceil(K/128)]
  (BlockWise1x128: one scale per row and 128-wide K block), ``scale_b`` [ceil(N/128), ceil(K/128)]
  (BlockWise128x128). The scales change along K, so every K tile's product is taken on its own
  (``tl.dot`` with a fresh accumulator: a promotion of the tensor cores' fp8 sums to full fp32
  every BLOCK_K <= 128, as DeepGEMM does) and added to the fp32 accumulator times its scales.
* per-row (RowWise): ``scale_a`` with M elements ([M] or [M, 1]), ``scale_b`` with N ([N], [1, N]);
* per-tensor (TensorWise): one element each (per-row and per-tensor may be mixed). Both apply the
  scales once, in the epilogue; the K loop accumulates in the tensor cores (Triton's default on
  sm_90, what ``torch._scaled_mm(use_fast_accum=True)`` does).

Two families, named and knobbed like ``matmul.tiled`` / ``matmul.persistent_tma`` so the search
ports points between them: a non-persistent tiled kernel and a persistent kernel (optional warp
specialization, sub-tiled TMA-store epilogue), both loading operands through host TMA descriptors.
No pointer-load variant: Triton 3.6 does not pipeline pointer loads of fp8 tiles 64 or more
elements deep (AOT for sm_90a: one shared-memory buffer whatever num_stages, 255 registers and
500-1400 bytes of spills at 64x64x128 .. 128x128x128), and 32-deep tiles use one wgmma per step.
fp8 wgmma needs both operands K-major in shared memory: A [M, K] and B [N, K] already are, so
B's tile is used transposed (``b.T``), never copied.

Every rendered module also runs under ``TRITON_INTERPRET=1`` on CPU tensors: the interpreter
decodes e4m3 exactly (finite values; checked against torch's decoding of all 256 codes) and
multiplies in fp32, so the kernels need no upcast there.

Blockwise cost (AOT TTGIR for sm_90a): Triton waits for each K block's wgmma before its promotion
(``warp_group_dot_wait`` with 0 pending), so the promotion FMAs do not overlap the next block's MMAs
within a CTA; two CTAs per SM (64x128 tiles, 4 warps, 4 stages: 98 KB, 152 registers) overlap them
across CTAs. Deferring each promotion by one K block in the source did not help: Triton then stopped
pipelining the TMA loads (one buffer) and still waited with 0 pending.

Precision (knob ``MMA``): e4m3 tensor-core operands (fast; Hopper's fp8 wgmma accumulates with a 13-bit
mantissa, so each K tile's sum is off an fp32 sum by up to 2^-13), or both tiles upcast to bf16 in
registers (exact for every e4m3 value) for a bf16 wgmma that sums in fp32, as the reference's
dequantise-then-fp32-matmul does (half the tensor-core rate). The output is rounded to nearest even in
both, under the interpreter too (its casts truncate).

A CUTLASS sibling, ``fp8_matmul.cutlass_sm90`` (``cutlass_fp8_gemm.py``), runs CUTLASS's own blockwise
mainloop for the same task.

``valid()`` assumes the blockwise mode (the task's): two fp32 register tiles (the accumulator and
the K tile's product) must fit a thread without spilling; fp8 operands take one byte in shared
memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families.base import SM90_SMEM_PER_BLOCK, Family, Knob
from kernelarc.families.matmul import _GROUPED_PID, _reg_cap, _uses_wgmma, pad_k_source  # the bf16 GEMM's

SMEM_LIMIT = SM90_SMEM_PER_BLOCK
SMEM_SLACK = 1024  # Triton's barriers
ELEM = 1  # e4m3 bytes
OUT_ELEM = 2  # bf16 output bytes
SCALE_BLOCK = 128  # the Quant recipes' block edge (1x128 activations, 128x128 weights)
REG_OVERHEAD = 32  # addresses, scales, loop state (AOT sweep of the bf16 families: 20-40)


# ---------------------------------------------------------------------------------------
# resource model
# ---------------------------------------------------------------------------------------


def _mainloop_smem(k: Mapping[str, Any]) -> int:
    bufs = k["num_stages"] if _uses_wgmma(k["BLOCK_M"], k["num_warps"]) else k["num_stages"] - 1
    # MMA=bf16 adds none (AOT for sm_90a: 131 KB at 128x128x128 and 4 stages, as the fp8 operands take)
    return max(bufs, 1) * (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] * ELEM


def _regs_estimate(k: Mapping[str, Any], warps: int) -> float:
    """fp32 registers per thread: accumulator + the K tile's product (blockwise), + overhead."""
    threads = 32 * warps
    tile = k["BLOCK_M"] * k["BLOCK_N"] / threads
    regs = 2 * tile + REG_OVERHEAD
    if not _uses_wgmma(k["BLOCK_M"], warps) or k["num_stages"] == 1:
        regs += (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] / (4 * threads)  # fp8 quads in registers
    if k.get("MMA") == "bf16":  # the upcast passes both tiles through registers as bf16 pairs
        regs += (k["BLOCK_M"] + k["BLOCK_N"]) * k["BLOCK_K"] / (2 * threads)
    return regs


def _common_valid(k: Mapping[str, Any], epilogue_smem: int = 0, reg_warps: int | None = None) -> bool:
    if SCALE_BLOCK % k["BLOCK_K"]:
        return False  # a K tile must not straddle two scale blocks
    if not _uses_wgmma(k["BLOCK_M"], k["num_warps"]):
        return False  # fp8 tiles below a warpgroup's 64 rows fall to mma.sync: not a Hopper design
    if _mainloop_smem(k) + epilogue_smem > SMEM_LIMIT - SMEM_SLACK:
        return False
    warps = reg_warps or k["num_warps"]
    return _regs_estimate(k, warps) <= _reg_cap(warps)


# ---------------------------------------------------------------------------------------
# shared source pieces
# ---------------------------------------------------------------------------------------

_HEADER = '''"""KernelArc candidate rendered by kernel family {family}.

fp8 e4m3 GEMM, C = (A * scale_a) @ (B * scale_b).T in bf16; scaling read from the scale shapes
(blockwise 1x128 / 128x128, per-row, per-tensor).

Knobs: {knobs}
"""

import os

import torch
import triton
import triton.language as tl
{extra_imports}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_SCALE = 128  # edge of the scale blocks (1x128 activations, 128x128 weights)
SCALE_BLOCK = tl.constexpr(_SCALE)
MMA_BF16 = tl.constexpr({mma_bf16})  # operands upcast to bf16 (exact) before the dot: fp32 sums
IN_INTERPRETER = tl.constexpr(INTERPRET)  # its bf16 casts truncate and its bf16 dots multiply integers


@triton.jit
def _to_bf16(x):
    # compiled code rounds to nearest even (cvt.rn); the interpreter truncates, so it rounds by hand
    # first (the result is then exact in bf16), or a CPU run would differ from the GPU's by an ulp
    if IN_INTERPRETER:
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        x = u.to(tl.float32, bitcast=True)
    return x.to(tl.bfloat16)
'''


def _header(family: str, knobs: Mapping[str, Any], extra_imports: str = "") -> str:
    shown = ", ".join(f"{k}={knobs[k]!r}" for k in sorted(knobs))
    mma_bf16 = knobs["MMA"] == "bf16"
    return _HEADER.format(family=family, knobs=shown, extra_imports=extra_imports, mma_bf16=mma_bf16)


def _consts(values: Mapping[str, Any]) -> str:
    return "".join(f"{n} = {v!r}\n" for n, v in values.items())


# The launcher's side of the scaling: one function every rendered module shares.
_SCALES = '''

def _scales(scale_a, scale_b, M, N, K):
    """(blockwise, sa, sb, strides): the scaling mode read from the scale shapes (as torch._scaled_mm
    and SOL-ExecBench's ScalingType define them) and the fp32 scale tensors the kernel indexes.

    blockwise: sa [M, ceil(K/128)], sb [ceil(N/128), ceil(K/128)]; strides (sa_m, sa_k, sb_n, sb_k).
    outer (per-row and/or per-tensor): sa with M or 1 elements, sb with N or 1; strides (sa_m, 0, sb_n, 0),
    a stride of 0 broadcasting a per-tensor scale.
    """
    kb = triton.cdiv(K, _SCALE)
    nb = triton.cdiv(N, _SCALE)
    sa = scale_a.to(torch.float32)
    sb = scale_b.to(torch.float32)
    if sa.dim() == 2 and sb.dim() == 2 and tuple(sa.shape) == (M, kb) and tuple(sb.shape) == (nb, kb):
        return True, sa, sb, (sa.stride(0), sa.stride(1), sb.stride(0), sb.stride(1))
    if sa.numel() in (1, M) and sb.numel() in (1, N) and sa.dim() <= 2 and sb.dim() <= 2:
        sa = sa.reshape(-1).contiguous()
        sb = sb.reshape(-1).contiguous()
        return False, sa, sb, (int(sa.numel() > 1), 0, int(sb.numel() > 1), 0)
    raise ValueError(
        f"unsupported scale shapes {tuple(scale_a.shape)}, {tuple(scale_b.shape)} for M={M} N={N} K={K}: "
        f"expected blockwise ({M}, {kb}) and ({nb}, {kb}), per-row ({M},) / ({N},), or per-tensor (1,)"
    )


def _check_operands(A, B):
    if A.dim() != 2 or B.dim() != 2 or A.shape[1] != B.shape[1]:
        raise ValueError(f"A [M, K] and B [N, K] expected, got {tuple(A.shape)} and {tuple(B.shape)}")
    if A.dtype != torch.float8_e4m3fn or B.dtype != torch.float8_e4m3fn:
        raise ValueError(f"float8_e4m3fn operands expected, got {A.dtype} and {B.dtype}")
'''

# TMA needs 16-byte row strides, 16 fp8 elements; padding K with zeros adds nothing to the product and
# leaves the scale blocks (ceil(K/128)) unchanged.
_PAD_K = pad_k_source(16)

# Per K tile, blockwise: the tile's product times its scales, added to the accumulator. With
# BLOCK_N <= 128 a tile's columns share one weight-block scale, folded into the row scales (one
# FMA per element); wider tiles take the outer product of the two scale vectors.
_BLOCK_SCALE_LINES = [
    "kb = off_k // SCALE_BLOCK",
    "s_a = tl.load(sa_ptr + rows_a * sa_sm + kb * sa_sk)",
    "if BLOCK_N <= SCALE_BLOCK:",
    "    s_b = tl.load(sb_ptr + (off_n // SCALE_BLOCK) * sb_sn + kb * sb_sk)",
    "    acc += tl.dot(a, b.T) * (s_a * s_b)[:, None]",
    "else:",
    "    s_b = tl.load(sb_ptr + (cols_b // SCALE_BLOCK) * sb_sn + kb * sb_sk)",
    "    acc += tl.dot(a, b.T) * (s_a[:, None] * s_b[None, :])",
]

_OUTER_SCALE_LINES = [
    "# per-row / per-tensor: one scale multiply in the epilogue (stride 0 broadcasts a tensor scale)",
    "acc = acc * tl.load(sa_ptr + rows_a * sa_sm)[:, None] * tl.load(sb_ptr + cols_b * sb_sn)[None, :]",
]


def _indent(lines: list[str], n: int) -> list[str]:
    return [" " * n + ln for ln in lines]


def _k_step_lines(load_lines: list[str], indent: int) -> list[str]:
    """Body of the K loop: load the operand tiles, then blockwise-scaled or plain accumulation."""
    body = [
        *load_lines,
        "if MMA_BF16:",
        "    a = a.to(tl.bfloat16)",
        "    b = b.to(tl.bfloat16)",
        "    if IN_INTERPRETER:  # the interpreter's dot reads bf16 storage as integers: fp32 holds them exactly",
        "        a = a.to(tl.float32)",
        "        b = b.to(tl.float32)",
        "if BLOCKWISE:",
        *_indent(_BLOCK_SCALE_LINES, 4),
        "else:",
        "    acc = tl.dot(a, b.T, acc)",
    ]
    return _indent(body, indent)


# ---------------------------------------------------------------------------------------
# tiled
# ---------------------------------------------------------------------------------------


def _tiled_kernel_src() -> str:
    lines = [
        "",
        "",
        "@triton.jit",
        "def fp8_matmul_kernel(a_desc, b_desc, c_ptr, sa_ptr, sb_ptr, M, N, K, stride_cm,",
        "                      sa_sm, sa_sk, sb_sn, sb_sk,",
        "                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,",
        "                      GROUP_M: tl.constexpr, BLOCKWISE: tl.constexpr, INT64: tl.constexpr):",
        "    pid = tl.program_id(0)",
        "    num_pid_m = tl.cdiv(M, BLOCK_M)",
        "    num_pid_n = tl.cdiv(N, BLOCK_N)",
        "    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)",
        "    off_m = pid_m * BLOCK_M",
        "    off_n = pid_n * BLOCK_N",
        "    offs_m = off_m + tl.arange(0, BLOCK_M)",
        "    offs_n = off_n + tl.arange(0, BLOCK_N)",
        "    # scale rows / columns past the edge read row 0 (their outputs are never stored)",
        "    rows_a = tl.where(offs_m < M, offs_m, 0)",
        "    cols_b = tl.where(offs_n < N, offs_n, 0)",
        "    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "    for off_k in range(0, K, BLOCK_K):",
    ]
    # TMA fills out-of-bounds rows and the K tail with zeros
    lines += _k_step_lines(["a = a_desc.load([off_m, off_k])", "b = b_desc.load([off_n, off_k])"], 8)
    lines += [
        "    if not BLOCKWISE:",
        *_indent(_OUTER_SCALE_LINES, 8),
        "    if INT64:",
        "        offs_m = offs_m.to(tl.int64)",
        "    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :]",
        "    c_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)",
        "    tl.store(c_ptrs, _to_bf16(acc), mask=c_mask)",
    ]
    return "\n".join(lines) + "\n"


_TILED_LAUNCHER = """

def run(A, B, scale_a, scale_b):
    _check_operands(A, B)
    M, K0 = A.shape
    N = B.shape[0]
    blockwise, sa, sb, s_strides = _scales(scale_a, scale_b, M, N, K0)
    A, B, K = _aligned_k(A.contiguous(), B.contiguous())
    C = torch.empty((M, N), device=A.device, dtype=torch.bfloat16)
    if M == 0 or N == 0:
        return C
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N),)
    a_desc = TensorDescriptor(A, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    b_desc = TensorDescriptor(B, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    fp8_matmul_kernel[grid](
        a_desc, b_desc, C, sa, sb, M, N, K, C.stride(0), *s_strides,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, BLOCKWISE=blockwise,
        INT64=C.numel() >= 2**31, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return C
"""


def render_tiled(knobs: Mapping[str, Any]) -> str:
    k = TILED.check_point(knobs)
    consts = {
        "BLOCK_M": k["BLOCK_M"],
        "BLOCK_N": k["BLOCK_N"],
        "BLOCK_K": k["BLOCK_K"],
        "GROUP_M": k["GROUP_M"],
        "NUM_WARPS": k["num_warps"],
        "NUM_STAGES": k["num_stages"],
    }
    extra = "from triton.tools.tensor_descriptor import TensorDescriptor\n"
    src = _header(TILED.name, k, extra) + "\n" + _consts(consts) + _SCALES + _PAD_K + _GROUPED_PID
    return src + _tiled_kernel_src() + _TILED_LAUNCHER


def valid_tiled(k: Mapping[str, Any]) -> bool:
    return _common_valid(k)


# ---------------------------------------------------------------------------------------
# persistent + TMA
# ---------------------------------------------------------------------------------------


def _subtile_store_lines(subtile: int, indent: str) -> list[str]:
    """Epilogue: convert and TMA-store the accumulator in ``subtile`` column slices."""
    if subtile == 1:
        return [f"{indent}c_desc.store([off_cm, off_cn], _to_bf16(acc))"]
    return [
        f"{indent}acc0, acc1 = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))",
        f"{indent}c_desc.store([off_cm, off_cn], _to_bf16(acc0))",
        f"{indent}c_desc.store([off_cm, off_cn + SUB_N], _to_bf16(acc1))",
    ]


def _persistent_kernel_src(k: Mapping[str, Any]) -> str:
    lines = [
        "",
        "",
        "@triton.jit",
        "def fp8_matmul_kernel(a_desc, b_desc, c_desc, c_ptr, sa_ptr, sb_ptr, M, N, K,",
        "                      sa_sm, sa_sk, sb_sn, sb_sk,",
        "                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,",
        "                      GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, SUB_N: tl.constexpr,",
        "                      FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, C_TMA: tl.constexpr,",
        "                      BLOCKWISE: tl.constexpr):",
        "    start_pid = tl.program_id(0)",
        "    num_pid_m = tl.cdiv(M, BLOCK_M)",
        "    num_pid_n = tl.cdiv(N, BLOCK_N)",
        "    k_tiles = tl.cdiv(K, BLOCK_K)",
        "    num_tiles = num_pid_m * num_pid_n",
        "    # a second tile counter for the epilogue keeps prologue and epilogue independent",
        "    # (what Triton's loop flattening and warp specialization expect)",
        "    tile_id_c = start_pid - NUM_SMS",
        "    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN,",
        "                            warp_specialize=WARP_SPECIALIZE):",
        "        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)",
        "        off_m = pid_m * BLOCK_M",
        "        off_n = pid_n * BLOCK_N",
        "        offs_m = off_m + tl.arange(0, BLOCK_M)",
        "        offs_n = off_n + tl.arange(0, BLOCK_N)",
        "        rows_a = tl.where(offs_m < M, offs_m, 0)",
        "        cols_b = tl.where(offs_n < N, offs_n, 0)",
        "        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "        for ki in range(k_tiles):",
    ]
    loads = ["off_k = ki * BLOCK_K", "a = a_desc.load([off_m, off_k])", "b = b_desc.load([off_n, off_k])"]
    lines += _k_step_lines(loads, 12)
    lines += [
        "        if not BLOCKWISE:",
        *_indent(_OUTER_SCALE_LINES, 12),
        "        tile_id_c += NUM_SMS",
        "        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)",
        "        off_cm = pid_m * BLOCK_M",
        "        off_cn = pid_n * BLOCK_N",
        "        if C_TMA:",
    ]
    lines += _subtile_store_lines(k["EPILOGUE_SUBTILE"], " " * 12)
    lines += [
        "        else:",
        "            rows = off_cm + tl.arange(0, BLOCK_M)",
        "            cols = off_cn + tl.arange(0, BLOCK_N)",
        "            c_ptrs = c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]",
        "            tl.store(c_ptrs, _to_bf16(acc), mask=(rows[:, None] < M) & (cols[None, :] < N))",
    ]
    return "\n".join(lines) + "\n"


_PERSISTENT_LAUNCHER = """

def _num_sms(device):
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4  # interpreter: a few programs, so the tile loop runs several times


def run(A, B, scale_a, scale_b):
    _check_operands(A, B)
    M, K0 = A.shape
    N = B.shape[0]
    blockwise, sa, sb, s_strides = _scales(scale_a, scale_b, M, N, K0)
    A, B, K = _aligned_k(A.contiguous(), B.contiguous())
    C = torch.empty((M, N), device=A.device, dtype=torch.bfloat16)
    if M == 0 or N == 0:
        return C
    c_tma = N % 8 == 0  # TMA stores need 16-byte row strides
    sub_n = BLOCK_N // EPILOGUE_SUBTILE
    num_sms = _num_sms(A.device) * NUM_SMS_MULT
    num_tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    grid = (max(1, min(num_sms, num_tiles)),)
    a_desc = TensorDescriptor(A, [M, K], [K, 1], [BLOCK_M, BLOCK_K])
    b_desc = TensorDescriptor(B, [N, K], [K, 1], [BLOCK_N, BLOCK_K])
    c_desc = TensorDescriptor(C, [M, N], [N, 1], [BLOCK_M, sub_n]) if c_tma else None
    fp8_matmul_kernel[grid](
        a_desc, b_desc, c_desc, C, sa, sb, M, N, K, *s_strides,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, NUM_SMS=num_sms,
        SUB_N=sub_n, FLATTEN=FLATTEN, WARP_SPECIALIZE=WARP_SPECIALIZE and not INTERPRET, C_TMA=c_tma,
        BLOCKWISE=blockwise, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return C
"""


def render_persistent(knobs: Mapping[str, Any]) -> str:
    k = PERSISTENT.check_point(knobs)
    consts = {
        "BLOCK_M": k["BLOCK_M"],
        "BLOCK_N": k["BLOCK_N"],
        "BLOCK_K": k["BLOCK_K"],
        "GROUP_M": k["GROUP_M"],
        "NUM_SMS_MULT": k["NUM_SMS_MULT"],
        "EPILOGUE_SUBTILE": k["EPILOGUE_SUBTILE"],
        "FLATTEN": k["FLATTEN"],
        "WARP_SPECIALIZE": k["WARP_SPECIALIZE"],
        "NUM_WARPS": k["num_warps"],
        "NUM_STAGES": k["num_stages"],
    }
    extra = "from triton.tools.tensor_descriptor import TensorDescriptor\n"
    src = _header(PERSISTENT.name, k, extra) + "\n" + _consts(consts) + _SCALES + _PAD_K + _GROUPED_PID
    return src + _persistent_kernel_src(k) + _PERSISTENT_LAUNCHER


def _ws_supported(k: Mapping[str, Any]) -> bool:
    """Where Triton 3.6 warp-specializes the persistent loop with host descriptors on sm_90a (the
    bf16 family's AOT sweep, NOTES_compute.md): 4 warps, no flattening, 64-row tiles up to 128
    columns (other forms are ignored or crash the compiler's warp-specialization pass)."""
    return (
        k["num_warps"] == 4
        and not k["FLATTEN"]
        and k["num_stages"] >= 2
        and k["BLOCK_M"] == 64
        and k["BLOCK_N"] <= 128
        and k["EPILOGUE_SUBTILE"] == 1
    )


def valid_persistent(k: Mapping[str, Any]) -> bool:
    bn, sub = k["BLOCK_N"], k["EPILOGUE_SUBTILE"]
    if bn // sub * OUT_ELEM < 16:  # a TMA box row must hold at least 16 bytes
        return False
    # the persistent loop keeps the pipeline buffers live across tiles: the epilogue's staging
    # buffer (BLOCK_M x BLOCK_N/SUBTILE bf16) comes on top
    epi = k["BLOCK_M"] * (bn // sub) * OUT_ELEM
    if k["WARP_SPECIALIZE"]:
        if not _ws_supported(k):
            return False
        # two consumer warpgroups: registers as for 8 warps; a second staging buffer (host descriptors)
        return _common_valid(k, epilogue_smem=2 * epi, reg_warps=8)
    return _common_valid(k, epilogue_smem=epi)


# ---------------------------------------------------------------------------------------
# the families
# ---------------------------------------------------------------------------------------

_K_BM = Knob("BLOCK_M", (64, 128, 256), "tiling", "rows of C per tile (the MMA's M side)")
_K_BN = Knob("BLOCK_N", (32, 64, 128, 256), "tiling", "columns of C per tile")
_K_BK = Knob("BLOCK_K", (32, 64, 128), "tiling", "depth of one K step; divides the 128-wide scale blocks")
_K_GROUP = Knob("GROUP_M", (1, 2, 4, 8, 16, 32), "scheduling", "row-blocks per L2-friendly group")
_K_WARPS = Knob("num_warps", (4, 8, 16), "scheduling", "warps per program")
_K_STAGES = Knob("num_stages", (1, 2, 3, 4, 5, 6, 7), "scheduling", "software-pipeline depth")
# Hopper's e4m3 wgmma keeps 13 mantissa bits in its accumulator and truncates the rest (DeepSeek-V3's
# report, SageAttention2), so each K tile's sum is off the fp32 dequantise-then-matmul of the reference
# by up to 2^-13 relative; promotion every <= 128 K bounds it but cannot remove it. Where the product is
# re-quantised downstream (a blockwise cast to e4m3 of an activation computed from it), that error moves
# bf16 roundings and whole fp8 steps: Quant/004 matched 91.7% of elements at its tolerance on the H200
# (a simulated 13-bit accumulator gives 93%, exact products summed in fp32 100%). bf16 tiles hold every
# e4m3 value exactly and bf16 wgmma sums in fp32: the reference's numbers at half the tensor-core rate.
_K_MMA = Knob("MMA", ("fp8", "bf16"), "precision", "tensor-core operands: e4m3 (fast, 13-bit accumulator) "
              "or bf16 (exact upcast, fp32 sums like the reference)")  # fmt: skip
_TILE_KNOBS = (_K_BM, _K_BN, _K_BK, _K_GROUP, _K_WARPS, _K_STAGES, _K_MMA)
# conservative start (never a tuned point): one warpgroup, 64x64 tiles, a 128-deep K step (one
# scale block per step: the recipe's own granularity), double buffering
_TILE_START = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 128, "GROUP_M": 1, "num_warps": 4, "num_stages": 2,
               "MMA": "fp8"}  # fmt: skip

TILED = Family(
    name="fp8_matmul.tiled",
    task="fp8_matmul",
    description="fp8 e4m3 tiled GEMM (TMA operand loads), blockwise / per-row / per-tensor scales",
    knobs=_TILE_KNOBS,
    start=dict(_TILE_START),
    render=render_tiled,
    valid=valid_tiled,
)

PERSISTENT = Family(
    name="fp8_matmul.persistent_tma",
    task="fp8_matmul",
    description="fp8 e4m3 persistent GEMM over TMA descriptors, scales in the K loop or epilogue",
    knobs=(
        *_TILE_KNOBS,
        Knob("NUM_SMS_MULT", (1, 2, 3, 4), "scheduling", "persistent programs per SM"),
        Knob("FLATTEN", (False, True), "scheduling", "flatten the tile and K loops into one pipeline"),
        Knob("WARP_SPECIALIZE", (False, True), "scheduling", "producer/consumer warp specialization"),
        Knob("EPILOGUE_SUBTILE", (1, 2), "memory", "store C in this many column slices"),
    ),
    start={**_TILE_START, "NUM_SMS_MULT": 1, "FLATTEN": False, "WARP_SPECIALIZE": False, "EPILOGUE_SUBTILE": 1},
    render=render_persistent,
    valid=valid_persistent,
)

FAMILIES = [TILED, PERSISTENT]


# ---------------------------------------------------------------------------------------
# ahead-of-time compile specs (tests, resource notes)
# ---------------------------------------------------------------------------------------

_D16 = [["tt.divisibility", 16]]


def aot_jobs(family: str, knobs: Mapping[str, Any], M: int = 4096, N: int = 4096, K: int = 4096,
             blockwise: bool = True) -> list[dict]:  # fmt: skip
    """How a rendered module's launcher specializes its kernel for one shape (multiples of 128):
    ``kernel``, ``signature``, ``constexprs``, ``attrs`` and ``options`` for
    ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``."""
    fam = {f.name: f for f in FAMILIES}[family]
    k = fam.check_point(knobs)
    opts = {"num_warps": k["num_warps"], "num_stages": k["num_stages"]}
    # scale strides as the launcher passes them: blockwise (KB, 1, KB, 1); per-row (1, 0, 1, 0)
    kb = -(-K // SCALE_BLOCK)
    s_strides = {"sa_sm": kb, "sa_sk": 1, "sb_sn": kb, "sb_sk": 1} if blockwise else {}
    if family == PERSISTENT.name:
        sub_n = k["BLOCK_N"] // k["EPILOGUE_SUBTILE"]
        sig: dict[str, str] = {
            "a_desc": f"tensordesc<fp8e4nv[{k['BLOCK_M']},{k['BLOCK_K']}]>",
            "b_desc": f"tensordesc<fp8e4nv[{k['BLOCK_N']},{k['BLOCK_K']}]>",
            "c_desc": f"tensordesc<bf16[{k['BLOCK_M']},{sub_n}]>",
            "c_ptr": "*bf16",
            "sa_ptr": "*fp32",
            "sb_ptr": "*fp32",
            "M": "i32",
            "N": "i32",
            "K": "i32",
        }
        consts: dict[str, Any] = {
            "BLOCK_M": k["BLOCK_M"],
            "BLOCK_N": k["BLOCK_N"],
            "BLOCK_K": k["BLOCK_K"],
            "GROUP_M": k["GROUP_M"],
            "NUM_SMS": 132 * k["NUM_SMS_MULT"],
            "SUB_N": sub_n,
            "FLATTEN": k["FLATTEN"],
            "WARP_SPECIALIZE": k["WARP_SPECIALIZE"],
            "C_TMA": True,
            "BLOCKWISE": blockwise,
        }
    else:
        sig = {
            "a_desc": f"tensordesc<fp8e4nv[{k['BLOCK_M']},{k['BLOCK_K']}]>",
            "b_desc": f"tensordesc<fp8e4nv[{k['BLOCK_N']},{k['BLOCK_K']}]>",
            "c_ptr": "*bf16",
            "sa_ptr": "*fp32",
            "sb_ptr": "*fp32",
            "M": "i32",
            "N": "i32",
            "K": "i32",
            "stride_cm": "i32",
        }
        consts = {
            "BLOCK_M": k["BLOCK_M"],
            "BLOCK_N": k["BLOCK_N"],
            "BLOCK_K": k["BLOCK_K"],
            "GROUP_M": k["GROUP_M"],
            "BLOCKWISE": blockwise,
            "INT64": False,
        }
    for n in ("sa_sm", "sa_sk", "sb_sn", "sb_sk"):
        v = s_strides.get(n, 1 if n in ("sa_sm", "sb_sn") else 0)
        if v in (0, 1):  # Triton specializes integer arguments equal to 1 (and the 0 strides) as constants
            sig[n] = "constexpr"
            consts[n] = v
        else:
            sig[n] = "i32"
    for n in consts:
        if n not in sig:
            sig[n] = "constexpr"
    # keep the kernel's own argument order
    names = _KERNEL_ARGS[family]
    sig = {n: sig[n] for n in names}
    attrs = {(i,): _D16 for i, n in enumerate(names) if sig[n] in ("*fp8e4nv", "*bf16", "*fp32")}
    attrs.update({(names.index(n),): _D16 for n in ("M", "N", "K") if n in names})
    return [dict(kernel="fp8_matmul_kernel", signature=sig, constexprs=consts, attrs=attrs, options=opts)]


_SCALE_ARGS = ["sa_sm", "sa_sk", "sb_sn", "sb_sk"]
_KERNEL_ARGS = {
    "fp8_matmul.tiled": ["a_desc", "b_desc", "c_ptr", "sa_ptr", "sb_ptr", "M", "N", "K", "stride_cm", *_SCALE_ARGS,
                         "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "BLOCKWISE", "INT64"],
    "fp8_matmul.persistent_tma": ["a_desc", "b_desc", "c_desc", "c_ptr", "sa_ptr", "sb_ptr", "M", "N", "K",
                                  *_SCALE_ARGS, "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "NUM_SMS", "SUB_N",
                                  "FLATTEN", "WARP_SPECIALIZE", "C_TMA", "BLOCKWISE"],
}  # fmt: skip
