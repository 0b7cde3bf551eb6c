"""GEMM kernel families for the built-in ``matmul`` task (Hopper, sm_90a).

Task: ``run(A, B)`` with A [M, K] bf16 and B [N, K] bf16 (weight layout) returns
C = A @ B.T in bf16, accumulated in fp32, for any M, N, K >= 1.

Three families, each rendering a self-contained Triton module:

* ``matmul.tiled``: the classic non-persistent tiled kernel, one program per output
  tile in GROUP_M-swizzled order, operands loaded through pointers (cp.async) or TMA
  tensor descriptors, optional swap-AB (compute C^T = B A^T so a tiny M lands on the
  MMA's flexible N side).
* ``matmul.persistent_tma``: one program per SM (times a multiplier) looping over tiles,
  TMA descriptors made on the host or in the kernel, optional loop flattening, warp
  specialization (Triton 3.6 does this on Hopper too) and a sub-tiled TMA-store epilogue.
* ``matmul.splitk``: splits the K loop over SPLIT_K programs and reduces fp32 partials
  (a workspace plus a reduction kernel, or fp32 atomics): the design for skinny shapes
  such as M=16, N=8192, K=8192, where the output alone has too few tiles to fill 132 SMs.

Every rendered module runs on CUDA and under ``TRITON_INTERPRET=1`` on CPU tensors; in the
interpreter bf16 arithmetic is wrong, so kernels upcast operands to fp32 there (constexpr
``UPCAST``, set from the module-level ``INTERPRET`` flag).

``valid()`` encodes resource limits measured by compiling points ahead of time for sm_90a
(see NOTES_compute.md): shared memory <= 227 KB and no register spills for the fp32
accumulator.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families.base import SM90_SMEM_PER_BLOCK, Family, Knob

SMEM_LIMIT = SM90_SMEM_PER_BLOCK  # 232448 bytes; Triton adds a few barriers (SMEM_SLACK)
SMEM_SLACK = 1024
ELEM = 2  # bf16 bytes

_BLOCKS = (16, 32, 64, 128, 256)
_BLOCKS_K = (16, 32, 64, 128, 256)


# ---------------------------------------------------------------------------------------
# resource model (calibrated against AOT compiles for sm_90a; see NOTES_compute.md)
# ---------------------------------------------------------------------------------------


def _uses_wgmma(bm: int, warps: int) -> bool:
    # Triton 3.6 picks Hopper's wgmma when a warpgroup (4 warps) can own 64-row slabs;
    # otherwise it falls back to mma.sync (seen in the AOT sweep: BLOCK_M < 64 or 2 warps).
    return bm >= 64 and warps >= 4


def _mainloop_smem(bm: int, bn: int, bk: int, warps: int, stages: int) -> int:
    # wgmma: num_stages operand buffers; mma.sync path: num_stages - 1 (measured).
    bufs = stages if _uses_wgmma(bm, warps) else stages - 1
    return max(bufs, 1) * (bm * bk + bn * bk) * ELEM


def _regs_estimate(bm: int, bn: int, bk: int, warps: int, stages: int) -> float:
    """32-bit registers per thread that must stay live: the fp32 accumulator, plus the
    operand tiles when they pass through registers (mma.sync path, or no pipelining)."""
    threads = 32 * warps
    regs = bm * bn / threads
    if not _uses_wgmma(bm, warps) or stages == 1:
        regs += (bm * bk + bn * bk) / (2 * threads)  # bf16 pairs
    return regs


def _reg_cap(warps: int) -> int:
    return min(255, 65536 // (32 * warps))


def _common_valid(k: Mapping[str, Any], epilogue_smem: int = 0) -> bool:
    bm, bn, bk = k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"]
    warps, stages = k["num_warps"], k["num_stages"]
    if _mainloop_smem(bm, bn, bk, warps, stages) + epilogue_smem > SMEM_LIMIT - SMEM_SLACK:
        return False
    # at or above the per-thread cap ptxas spills (or, at 16 warps, refuses to compile)
    return _regs_estimate(bm, bn, bk, warps, stages) < _reg_cap(warps)


# ---------------------------------------------------------------------------------------
# rendering helpers
# ---------------------------------------------------------------------------------------

_HEADER = '''"""KernelArc candidate rendered by kernel family {family}.

Knobs: {knobs}
"""

import os

import torch
import triton
import triton.language as tl
{extra_imports}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
'''


def _header(family: str, knobs: Mapping[str, Any], extra_imports: str = "") -> str:
    shown = ", ".join(f"{k}={knobs[k]!r}" for k in sorted(knobs))
    return _HEADER.format(family=family, knobs=shown, extra_imports=extra_imports)


def _consts(knobs: Mapping[str, Any], names: list[str]) -> str:
    return "".join(f"{n} = {knobs[n]!r}\n" for n in names)


def pad_k_source(multiple: int) -> str:
    """The rendered ``_aligned_k``: K padded with zeros to ``multiple`` elements (16 bytes of the operand dtype)."""
    return f'''

def _aligned_k(A, B):
    """TMA needs 16-byte row strides: pad K with zeros to a multiple of {multiple} when it is not."""
    M, K = A.shape
    N = B.shape[0]
    if K % {multiple} == 0 and A.data_ptr() % 16 == 0 and B.data_ptr() % 16 == 0:
        return A, B, K
    Kp = (K + {multiple - 1}) // {multiple} * {multiple}
    Ap = torch.zeros((M, Kp), device=A.device, dtype=A.dtype)
    Bp = torch.zeros((N, Kp), device=B.device, dtype=B.dtype)
    Ap[:, :K] = A
    Bp[:, :K] = B
    return Ap, Bp, Kp
'''


_PAD_K = pad_k_source(8)  # bf16

_GROUPED_PID = """

@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # GROUP_M-swizzled order: GROUP_M row-blocks share each column sweep, so the B tiles
    # they read stay in L2 (GROUP_M = 1 is plain row-major order).
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = tile_id // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((tile_id % num_pid_in_group) % group_size_m)
    pid_n = (tile_id % num_pid_in_group) // group_size_m
    return pid_m, pid_n
"""


# ---------------------------------------------------------------------------------------
# tiled / split-K (shared generator: out[p, q] = sum_k X[p, k] * Y[q, k])
# ---------------------------------------------------------------------------------------


def _tiled_kernel_src(memory: str, split_k: int, reduce: str) -> str:
    tma = memory == "tma"
    if tma:
        args = "x_desc, y_desc, c_ptr, P, Q, K, stride_cp, stride_cq, k_per_split, split_stride"
    else:
        args = "x_ptr, y_ptr, c_ptr, P, Q, K, stride_xp, stride_yq, stride_cp, stride_cq, k_per_split, split_stride"
    lines = [
        "",
        "",
        "@triton.jit",
        f"def matmul_kernel({args},",
        "                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,",
        "                  GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr, EVEN_K: tl.constexpr,",
        "                  INT64: tl.constexpr, UPCAST: tl.constexpr):",
        "    pid = tl.program_id(0)",
        "    num_pid_m = tl.cdiv(P, BLOCK_M)",
        "    num_pid_n = tl.cdiv(Q, BLOCK_N)",
        "    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)",
    ]
    if split_k > 1:
        lines += [
            "    pid_k = tl.program_id(1)",
            "    k_start = pid_k * k_per_split",
            "    k_end = tl.minimum(K, k_start + k_per_split)",
        ]
    else:
        lines += ["    k_start = 0", "    k_end = K"]
    lines += [
        "    num_k = tl.cdiv(k_end - k_start, BLOCK_K)",
        "    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)",
        "    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)",
        "    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
    ]
    if tma:
        lines += [
            "    off_xm = pid_m * BLOCK_M",
            "    off_yn = pid_n * BLOCK_N",
            "    for kk in range(0, num_k):",
            "        off_k = k_start + kk * BLOCK_K",
            "        x = x_desc.load([off_xm, off_k])",
            "        y = y_desc.load([off_yn, off_k])",
            "        if UPCAST:",
            "            x = x.to(tl.float32)",
            "            y = y.to(tl.float32)",
            "        acc = tl.dot(x, y.T, acc)",
        ]
    else:
        lines += [
            "    # rows past the edge read row 0 (never stored): no mask on the M/N sides",
            "    rows_x = tl.where(offs_m < P, offs_m, 0)",
            "    rows_y = tl.where(offs_n < Q, offs_n, 0)",
            "    if INT64:",
            "        rows_x = rows_x.to(tl.int64)",
            "        rows_y = rows_y.to(tl.int64)",
            "    offs_k = tl.arange(0, BLOCK_K)",
            "    x_ptrs = x_ptr + rows_x[:, None] * stride_xp + (k_start + offs_k)[None, :]",
            "    y_ptrs = y_ptr + rows_y[None, :] * stride_yq + (k_start + offs_k)[:, None]",
            "    for kk in range(0, num_k):",
            "        if EVEN_K:",
            "            x = tl.load(x_ptrs)",
            "            y = tl.load(y_ptrs)",
            "        else:",
            "            k_left = k_end - k_start - kk * BLOCK_K",
            "            x = tl.load(x_ptrs, mask=offs_k[None, :] < k_left, other=0.0)",
            "            y = tl.load(y_ptrs, mask=offs_k[:, None] < k_left, other=0.0)",
            "        if UPCAST:",
            "            x = x.to(tl.float32)",
            "            y = y.to(tl.float32)",
            "        acc = tl.dot(x, y, acc)",
            "        x_ptrs += BLOCK_K",
            "        y_ptrs += BLOCK_K",
        ]
    lines += [
        "    if INT64:",
        "        offs_m = offs_m.to(tl.int64)",
        "        offs_n = offs_n.to(tl.int64)",
        "    c_offs = offs_m[:, None] * stride_cp + offs_n[None, :] * stride_cq",
        "    c_mask = (offs_m[:, None] < P) & (offs_n[None, :] < Q)",
    ]
    if split_k == 1:
        lines += ["    tl.store(c_ptr + c_offs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)"]
    elif reduce == "atomic":
        lines += ['    tl.atomic_add(c_ptr + c_offs, acc, mask=c_mask, sem="relaxed")']
    else:
        lines += [
            "    # fp32 partial of split pid_k, laid out like C (reduced by splitk_reduce_kernel)",
            "    tl.store(c_ptr + pid_k.to(tl.int64) * split_stride + c_offs, acc, mask=c_mask)",
        ]
    return "\n".join(lines) + "\n"


_REDUCE_KERNEL = """

@triton.jit
def splitk_reduce_kernel(ws_ptr, c_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.load(ws_ptr + offs, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        # 64-bit split offset: SPLIT_K * M * N can pass 2**31 (an int32 product overflowed on the H200)
        acc += tl.load(ws_ptr + tl.cast(numel, tl.int64) * s + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, acc.to(c_ptr.dtype.element_ty), mask=mask)
"""


def _tiled_launcher_src(memory: str, split_k: int, reduce: str) -> str:
    tma = memory == "tma"
    lines = [
        "",
        "",
        "def run(A, B):",
        "    M, K = A.shape",
        "    N = B.shape[0]",
        "    A = A.contiguous()",
        "    B = B.contiguous()",
    ]
    if tma:
        lines += ["    A, B, K = _aligned_k(A, B)"]
    lines += [
        "    C = torch.empty((M, N), device=A.device, dtype=A.dtype)",
        "    if SWAP_AB:",
        "        # C^T = B @ A^T: the N side fills the MMA's M dimension (good when M is tiny)",
        "        X, Y, P, Q, stride_cp, stride_cq = B, A, N, M, 1, N",
        "    else:",
        "        X, Y, P, Q, stride_cp, stride_cq = A, B, M, N, N, 1",
        "    k_per_split = triton.cdiv(triton.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K",
        "    even_k = K % (BLOCK_K * SPLIT_K) == 0",
        "    int64 = max(A.numel(), B.numel(), C.numel() * SPLIT_K) >= 2**31",
        "    grid = (triton.cdiv(P, BLOCK_M) * triton.cdiv(Q, BLOCK_N), SPLIT_K)",
    ]
    if split_k == 1:
        lines += ["    out = C"]
    elif reduce == "atomic":
        lines += ["    out = torch.zeros((M, N), device=A.device, dtype=torch.float32)"]
    else:
        lines += ["    out = torch.empty((SPLIT_K, M, N), device=A.device, dtype=torch.float32)"]
    if tma:
        lines += [
            "    x_arg = TensorDescriptor(X, [P, K], [X.stride(0), 1], [BLOCK_M, BLOCK_K])",
            "    y_arg = TensorDescriptor(Y, [Q, K], [Y.stride(0), 1], [BLOCK_N, BLOCK_K])",
            "    strides = ()",
        ]
    else:
        lines += ["    x_arg, y_arg = X, Y", "    strides = (X.stride(0), Y.stride(0))"]
    lines += [
        "    matmul_kernel[grid](",
        "        x_arg, y_arg, out, P, Q, K, *strides, stride_cp, stride_cq, k_per_split, M * N,",
        "        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, SPLIT_K=SPLIT_K,",
        "        EVEN_K=even_k, INT64=int64, UPCAST=INTERPRET,",
        "        num_warps=NUM_WARPS, num_stages=NUM_STAGES,",
        "    )",
    ]
    if split_k > 1:
        n_splits = 1 if reduce == "atomic" else split_k
        lines += [
            "    numel = M * N",
            "    splitk_reduce_kernel[(triton.cdiv(numel, REDUCE_BLOCK),)](",
            f"        out, C, numel, SPLIT_K={n_splits}, BLOCK=REDUCE_BLOCK, num_warps=4)",
        ]
    lines += ["    return C"]
    return "\n".join(lines) + "\n"


def _render_tiled_like(family: str, k: Mapping[str, Any]) -> str:
    memory = k.get("MEMORY", "pointer")
    split_k = k.get("SPLIT_K", 1)
    reduce = k.get("REDUCE", "partials")
    extra = "from triton.tools.tensor_descriptor import TensorDescriptor\n" if memory == "tma" else ""
    consts = {
        "BLOCK_M": k["BLOCK_M"],
        "BLOCK_N": k["BLOCK_N"],
        "BLOCK_K": k["BLOCK_K"],
        "GROUP_M": k["GROUP_M"],
        "SPLIT_K": split_k,
        "SWAP_AB": k.get("SWAP_AB", False),
        "NUM_WARPS": k["num_warps"],
        "NUM_STAGES": k["num_stages"],
        "REDUCE_BLOCK": 1024,
    }
    src = _header(family, k, extra) + "\n" + _consts(consts, list(consts))
    if memory == "tma":
        src += _PAD_K
    src += _GROUPED_PID + _tiled_kernel_src(memory, split_k, reduce)
    if split_k > 1:
        src += _REDUCE_KERNEL
    src += _tiled_launcher_src(memory, split_k, reduce)
    return src


def render_tiled(knobs: Mapping[str, Any]) -> str:
    k = TILED.check_point(knobs)
    return _render_tiled_like(TILED.name, k)


def render_splitk(knobs: Mapping[str, Any]) -> str:
    k = SPLITK.check_point(knobs)
    return _render_tiled_like(SPLITK.name, k)


def valid_tiled(k: Mapping[str, Any]) -> bool:
    return _common_valid(k)


def valid_splitk(k: Mapping[str, Any]) -> bool:
    return _common_valid(k)


# ---------------------------------------------------------------------------------------
# persistent + TMA
# ---------------------------------------------------------------------------------------


def _subtile_store_lines(subtile: int, indent: str) -> list[str]:
    """Epilogue: convert and TMA-store the accumulator in `subtile` column slices."""
    if subtile == 1:
        return [f"{indent}c_desc.store([offs_cm, offs_cn], acc.to(dtype))"]
    out = [f"{indent}parts0 = acc"]
    # split the N side in halves repeatedly: reshape (BM, 2, n/2) -> permute -> split
    levels = {2: 1, 4: 2, 8: 3}[subtile]
    names = ["parts0"]
    width = "BLOCK_N"
    for _ in range(levels):
        new = []
        for name in names:
            a, b = f"{name}a", f"{name}b"
            out.append(
                f"{indent}{a}, {b} = tl.split(tl.permute(tl.reshape({name}, (BLOCK_M, 2, {width} // 2)), (0, 2, 1)))"
            )
            new += [a, b]
        names = new
        width = f"({width} // 2)"
    for i, name in enumerate(names):
        out.append(f"{indent}c_desc.store([offs_cm, offs_cn + {i} * SUB_N], {name}.to(dtype))")
    return out


def _persistent_kernel_src(k: Mapping[str, Any]) -> str:
    device_desc = k["DESCRIPTORS"] == "device"
    args = "a_ptr, b_ptr, c_ptr, M, N, K" if device_desc else "a_desc, b_desc, c_desc, c_ptr, M, N, K"
    lines = [
        "",
        "",
        "@triton.jit",
        f"def matmul_kernel({args},",
        "                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,",
        "                  GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr, SUB_N: tl.constexpr,",
        "                  FLATTEN: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,",
        "                  C_TMA: tl.constexpr, UPCAST: tl.constexpr):",
        "    dtype = c_ptr.dtype.element_ty",
        "    start_pid = tl.program_id(0)",
        "    num_pid_m = tl.cdiv(M, BLOCK_M)",
        "    num_pid_n = tl.cdiv(N, BLOCK_N)",
        "    k_tiles = tl.cdiv(K, BLOCK_K)",
        "    num_tiles = num_pid_m * num_pid_n",
    ]
    if device_desc:
        lines += [
            "    a_desc = tl.make_tensor_descriptor(a_ptr, shape=[M, K], strides=[K, 1],",
            "                                       block_shape=[BLOCK_M, BLOCK_K])",
            "    b_desc = tl.make_tensor_descriptor(b_ptr, shape=[N, K], strides=[K, 1],",
            "                                       block_shape=[BLOCK_N, BLOCK_K])",
            "    if C_TMA:",
            "        c_desc = tl.make_tensor_descriptor(c_ptr, shape=[M, N], strides=[N, 1],",
            "                                           block_shape=[BLOCK_M, SUB_N])",
        ]
    lines += [
        "    # a second tile counter for the epilogue keeps the prologue and epilogue",
        "    # independent (what Triton's loop flattening and warp specialization expect)",
        "    tile_id_c = start_pid - NUM_SMS",
        "    for tile_id in tl.range(start_pid, num_tiles, NUM_SMS, flatten=FLATTEN,",
        "                            warp_specialize=WARP_SPECIALIZE):",
        "        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, GROUP_M)",
        "        offs_am = pid_m * BLOCK_M",
        "        offs_bn = pid_n * BLOCK_N",
        "        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)",
        "        for ki in range(k_tiles):",
        "            offs_k = ki * BLOCK_K",
        "            a = a_desc.load([offs_am, offs_k])",
        "            b = b_desc.load([offs_bn, offs_k])",
        "            if UPCAST:",
        "                a = a.to(tl.float32)",
        "                b = b.to(tl.float32)",
        "            acc = tl.dot(a, b.T, acc)",
        "        tile_id_c += NUM_SMS",
        "        pid_m, pid_n = _tile_coords(tile_id_c, num_pid_m, num_pid_n, GROUP_M)",
        "        offs_cm = pid_m * BLOCK_M",
        "        offs_cn = pid_n * BLOCK_N",
        "        if C_TMA:",
    ]
    lines += _subtile_store_lines(k["EPILOGUE_SUBTILE"], " " * 12)
    lines += [
        "        else:",
        "            rows = offs_cm + tl.arange(0, BLOCK_M)",
        "            cols = offs_cn + tl.arange(0, BLOCK_N)",
        "            c_ptrs = c_ptr + rows[:, None].to(tl.int64) * N + cols[None, :]",
        "            tl.store(c_ptrs, acc.to(dtype), mask=(rows[:, None] < M) & (cols[None, :] < N))",
    ]
    return "\n".join(lines) + "\n"


def _persistent_launcher_src(k: Mapping[str, Any]) -> str:
    device_desc = k["DESCRIPTORS"] == "device"
    lines = [
        "",
        "",
        "def _num_sms(device):",
        '    if device.type == "cuda":',
        "        return torch.cuda.get_device_properties(device).multi_processor_count",
        "    return 4  # interpreter: a few programs, so the tile loop runs several times",
    ]
    if device_desc:
        lines += [
            "",
            "",
            "def _alloc(size, alignment, stream):",
            "    # scratch for the descriptors the kernel builds on the device",
            '    return torch.empty(size, device="cuda" if torch.cuda.is_available() and not INTERPRET',
            '                       else "cpu", dtype=torch.int8)',
        ]
    lines += [
        "",
        "",
        "def run(A, B):",
        "    M = A.shape[0]",
        "    N = B.shape[0]",
        "    A, B, K = _aligned_k(A.contiguous(), B.contiguous())",
        "    C = torch.empty((M, N), device=A.device, dtype=A.dtype)",
        "    c_tma = N % 8 == 0  # TMA stores need 16-byte row strides",
        "    sub_n = BLOCK_N // EPILOGUE_SUBTILE",
        "    num_sms = _num_sms(A.device) * NUM_SMS_MULT",
        "    num_tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)",
        "    grid = (max(1, min(num_sms, num_tiles)),)",
        "    ws = WARP_SPECIALIZE and not INTERPRET",
    ]
    if device_desc:
        lines += [
            "    triton.set_allocator(_alloc)",
            "    args = (A, B, C, M, N, K)",
        ]
    else:
        lines += [
            "    a_desc = TensorDescriptor(A, [M, K], [K, 1], [BLOCK_M, BLOCK_K])",
            "    b_desc = TensorDescriptor(B, [N, K], [K, 1], [BLOCK_N, BLOCK_K])",
            "    c_desc = TensorDescriptor(C, [M, N], [N, 1], [BLOCK_M, sub_n]) if c_tma else None",
            "    args = (a_desc, b_desc, c_desc, C, M, N, K)",
        ]
    lines += [
        "    matmul_kernel[grid](",
        "        *args,",
        "        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, NUM_SMS=num_sms,",
        "        SUB_N=sub_n, FLATTEN=FLATTEN, WARP_SPECIALIZE=ws, C_TMA=c_tma, UPCAST=INTERPRET,",
        "        num_warps=NUM_WARPS, num_stages=NUM_STAGES,",
        "    )",
        "    return C",
    ]
    return "\n".join(lines) + "\n"


def render_persistent(knobs: Mapping[str, Any]) -> str:
    k = PERSISTENT.check_point(knobs)
    extra = "" if k["DESCRIPTORS"] == "device" else "from triton.tools.tensor_descriptor import TensorDescriptor\n"
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
    src = _header(PERSISTENT.name, k, extra) + "\n" + _consts(consts, list(consts))
    src += _PAD_K + _GROUPED_PID + _persistent_kernel_src(k) + _persistent_launcher_src(k)
    return src


def valid_persistent(k: Mapping[str, Any]) -> bool:
    bn, sub = k["BLOCK_N"], k["EPILOGUE_SUBTILE"]
    if bn // sub < 8:  # a TMA box row must hold at least 16 bytes
        return False
    # the persistent loop keeps the pipeline buffers live across tiles, so the epilogue's
    # TMA-store staging buffer (BLOCK_M x BLOCK_N/SUBTILE) comes on top of them
    epi = k["BLOCK_M"] * (bn // sub) * ELEM
    if k["WARP_SPECIALIZE"]:
        if not _ws_supported(k):
            return False
        if k["DESCRIPTORS"] == "host":
            epi *= 2  # measured: a second staging buffer with host-side descriptors
        # the specialized loop runs on two consumer warpgroups: registers as for 8 warps
        return _common_valid({**k, "num_warps": 2 * k["num_warps"]}, epilogue_smem=epi)
    return _common_valid(k, epilogue_smem=epi)


def _ws_supported(k: Mapping[str, Any]) -> bool:
    """Where Triton 3.6 warp-specializes this persistent loop on sm_90a (AOT sweep, NOTES).

    4 warps only (with 8 or more the request is silently ignored), no loop flattening (it
    wins over specialization), wgmma tiles (BLOCK_M >= 64); 64-row tiles up to 128 columns
    with either descriptor kind; larger tiles only with in-kernel descriptors and a
    single-slice epilogue (the other forms crash the compiler's warp-specialization pass).
    """
    if k["num_warps"] != 4 or k["FLATTEN"] or k["num_stages"] < 2:
        return False
    bm, bn = k["BLOCK_M"], k["BLOCK_N"]
    if bm < 64:
        return False
    if bm == 64:
        return bn <= 128
    return k["DESCRIPTORS"] == "device" and k["EPILOGUE_SUBTILE"] == 1


# ---------------------------------------------------------------------------------------
# the families
# ---------------------------------------------------------------------------------------

_K_BM = Knob("BLOCK_M", _BLOCKS, "tiling", "rows of C per tile (the MMA's M side)")
_K_BN = Knob("BLOCK_N", _BLOCKS, "tiling", "columns of C per tile")
_K_BK = Knob("BLOCK_K", _BLOCKS_K, "tiling", "depth of one K step (operand tile width)")
_K_GROUP = Knob("GROUP_M", (1, 2, 4, 8, 16, 32), "scheduling", "row-blocks per L2-friendly group")
_K_WARPS = Knob("num_warps", (2, 4, 8, 16), "scheduling", "warps per program")
_K_STAGES = Knob("num_stages", (1, 2, 3, 4, 5, 6, 7), "scheduling", "software-pipeline depth")
_K_SWAP = Knob("SWAP_AB", (False, True), "algorithmic", "compute C^T = B A^T (tiny-M shapes)")
# the tile and pipeline knobs every GEMM family shares, and their conservative start (never a tuned point)
_TILE_KNOBS = (_K_BM, _K_BN, _K_BK, _K_GROUP, _K_WARPS, _K_STAGES)
_TILE_START = {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 1, "num_warps": 4, "num_stages": 2}

TILED = Family(
    name="matmul.tiled",
    task="matmul",
    dtypes=("bfloat16", "float16"),  # float32 sites go to matmul_f32
    description="Non-persistent tiled GEMM, GROUP_M-swizzled tile order, pointer or TMA operand loads",
    knobs=(
        *_TILE_KNOBS,
        Knob("MEMORY", ("pointer", "tma"), "memory", "operand loads: pointers (cp.async) or TMA descriptors"),
        _K_SWAP,
    ),
    start={
        **_TILE_START,
        "MEMORY": "pointer",
        "SWAP_AB": False,
    },
    render=render_tiled,
    valid=valid_tiled,
)

PERSISTENT = Family(
    name="matmul.persistent_tma",
    task="matmul",
    dtypes=("bfloat16", "float16"),  # float32 sites go to matmul_f32
    description="Persistent GEMM (grid = SMs x mult) over TMA descriptors, optional warp specialization",
    knobs=(
        *_TILE_KNOBS,
        Knob("NUM_SMS_MULT", (1, 2, 3, 4, 6, 8), "scheduling", "persistent programs per SM"),
        Knob("FLATTEN", (False, True), "scheduling", "flatten the tile and K loops into one pipeline"),
        Knob("WARP_SPECIALIZE", (False, True), "scheduling", "producer/consumer warp specialization"),
        Knob("EPILOGUE_SUBTILE", (1, 2, 4), "memory", "store C in this many column slices"),
        Knob("DESCRIPTORS", ("host", "device"), "memory", "TMA descriptors made on the host or in-kernel"),
    ),
    start={
        **_TILE_START,
        "NUM_SMS_MULT": 1,
        "FLATTEN": False,
        "WARP_SPECIALIZE": False,
        "EPILOGUE_SUBTILE": 1,
        "DESCRIPTORS": "host",
    },
    render=render_persistent,
    valid=valid_persistent,
)

SPLITK = Family(
    name="matmul.splitk",
    task="matmul",
    dtypes=("bfloat16", "float16"),  # float32 sites go to matmul_f32
    description="Split-K GEMM: K split over programs, fp32 partials reduced by a kernel or atomics",
    knobs=(
        *_TILE_KNOBS,
        Knob("SPLIT_K", (1, 2, 4, 8, 16, 32), "algorithmic", "programs sharing one output tile's K loop"),
        Knob("REDUCE", ("partials", "atomic"), "algorithmic", "fp32 workspace + reduce kernel, or atomics"),
        _K_SWAP,
    ),
    start={
        **_TILE_START,
        "SPLIT_K": 1,
        "REDUCE": "partials",
        "SWAP_AB": False,
    },
    render=render_splitk,
    valid=valid_splitk,
)

FAMILIES = [TILED, PERSISTENT, SPLITK]


# ---------------------------------------------------------------------------------------
# ahead-of-time compile specs (used by the tests and by the resource sweep in the notes)
# ---------------------------------------------------------------------------------------

_D16 = [["tt.divisibility", 16]]


def _aot_jobs(family: str, knobs: Mapping[str, Any], M: int = 4096, N: int = 4096, K: int = 4096) -> list[dict]:
    """How the launcher of a rendered module would specialize its kernels for one shape.

    Returns one dict per kernel: ``kernel`` (attribute of the rendered module), ``signature``,
    ``constexprs``, ``attrs`` (argument index -> divisibility) and ``options``, ready for
    ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``. Shapes must be
    multiples of 16, as on the GPU benchmarks.
    """
    fam = {f.name: f for f in FAMILIES}[family]
    k = fam.check_point(knobs)
    opts = {"num_warps": k["num_warps"], "num_stages": k["num_stages"]}
    if family == PERSISTENT.name:
        sub_n = k["BLOCK_N"] // k["EPILOGUE_SUBTILE"]
        if k["DESCRIPTORS"] == "device":
            sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16"}
        else:
            sig = {
                "a_desc": f"tensordesc<bf16[{k['BLOCK_M']},{k['BLOCK_K']}]>",
                "b_desc": f"tensordesc<bf16[{k['BLOCK_N']},{k['BLOCK_K']}]>",
                "c_desc": f"tensordesc<bf16[{k['BLOCK_M']},{sub_n}]>",
                "c_ptr": "*bf16",
            }
        sig.update({"M": "i32", "N": "i32", "K": "i32"})
        consts = {
            "BLOCK_M": k["BLOCK_M"],
            "BLOCK_N": k["BLOCK_N"],
            "BLOCK_K": k["BLOCK_K"],
            "GROUP_M": k["GROUP_M"],
            "NUM_SMS": 132 * k["NUM_SMS_MULT"],
            "SUB_N": sub_n,
            "FLATTEN": k["FLATTEN"],
            "WARP_SPECIALIZE": k["WARP_SPECIALIZE"],
            "C_TMA": True,
            "UPCAST": False,
        }
        sig.update({n: "constexpr" for n in consts})
        names = list(sig)
        attrs = {(names.index(n),): _D16 for n in ("a_ptr", "b_ptr", "c_ptr", "M", "N", "K") if n in names}
        return [dict(kernel="matmul_kernel", signature=sig, constexprs=consts, attrs=attrs, options=opts)]

    memory = k.get("MEMORY", "pointer")
    split_k = k.get("SPLIT_K", 1)
    swap = k.get("SWAP_AB", False)
    out_ty = "*bf16" if split_k == 1 else "*fp32"
    if memory == "tma":
        sig = {
            "x_desc": f"tensordesc<bf16[{k['BLOCK_M']},{k['BLOCK_K']}]>",
            "y_desc": f"tensordesc<bf16[{k['BLOCK_N']},{k['BLOCK_K']}]>",
            "c_ptr": out_ty,
        }
    else:
        sig = {"x_ptr": "*bf16", "y_ptr": "*bf16", "c_ptr": out_ty}
    sig.update({"P": "i32", "Q": "i32", "K": "i32"})
    if memory != "tma":
        sig.update({"stride_xp": "i32", "stride_yq": "i32"})
    sig.update({"stride_cp": "i32", "stride_cq": "i32", "k_per_split": "i32", "split_stride": "i32"})
    consts: dict[str, Any] = {
        "BLOCK_M": k["BLOCK_M"],
        "BLOCK_N": k["BLOCK_N"],
        "BLOCK_K": k["BLOCK_K"],
        "GROUP_M": k["GROUP_M"],
        "SPLIT_K": split_k,
        "EVEN_K": K % (k["BLOCK_K"] * split_k) == 0,
        "INT64": False,
        "UPCAST": False,
    }
    # Triton turns integer arguments equal to 1 into constants: one C stride is 1
    unit = "stride_cp" if swap else "stride_cq"
    sig[unit] = "constexpr"
    consts[unit] = 1
    for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "SPLIT_K", "EVEN_K", "INT64", "UPCAST"):
        sig[n] = "constexpr"
    names = list(sig)
    attrs = {(i,): _D16 for i, n in enumerate(names) if sig[n] in ("*bf16", "*fp32", "i32")}
    jobs = [dict(kernel="matmul_kernel", signature=sig, constexprs=consts, attrs=attrs, options=opts)]
    if split_k > 1:
        n_splits = 1 if k["REDUCE"] == "atomic" else split_k
        rsig = {"ws_ptr": "*fp32", "c_ptr": "*bf16", "numel": "i32", "SPLIT_K": "constexpr", "BLOCK": "constexpr"}
        jobs.append(
            dict(
                kernel="splitk_reduce_kernel",
                signature=rsig,
                constexprs={"SPLIT_K": n_splits, "BLOCK": 1024},
                attrs={(0,): _D16, (1,): _D16, (2,): _D16},
                options={"num_warps": 4, "num_stages": 2},
            )
        )
    return jobs
