"""A GEMM kernel family for float32 operands on tensor cores (Hopper, sm_90a).

Problems written in float32 (most SOL-ExecBench L1/L2 references: projections, their weight gradients,
batched attention products) run their matmuls on cuBLAS's FP32 SGEMM: CUDA cores, about 50 TFLOP/s on an
H200 (run DF), where the tensor cores do far more in bf16. Plain TF32 (what ``torch.backends.cuda.matmul.
allow_tf32`` turns on) keeps 10 mantissa bits and misses tolerances of 1e-3 on K of a thousand or more.
This family keeps fp32-class accuracy on tensor cores by splitting each operand into parts and summing the
products that matter (``PRECISION``):

* ``bf16x3``: ``a = a_hi + a_lo`` in bf16 (16 mantissa bits in all), ``a_hi b_lo + a_lo b_hi + a_hi b_hi``
  on bf16 MMAs with an fp32 accumulator: a product's relative error about 2**-16;
* ``tf32x3``: the same split in TF32: about 2**-21;
* ``bf16x6``: three bf16 parts (24 bits) and the six products above 2**-24;
* ``tf32``: one TF32 product (2**-11), for problems whose tolerance allows it.

``ALGO``: ``concat`` writes each operand's parts side by side along K (one pass) and runs one tensor-core GEMM
over them; ``inline`` splits every tile in the K loop (batched products always do); ``auto`` takes the parts
from M*N*K of 2**32 on. Which precision passes is the problem's tolerance's call: the guard checks every
candidate against a float64 reference on fresh inputs. Task (``matmul_f32``, served through composed problems'
GEMM sites): ``run(A, B)`` with A [..., M, K] and B [N, K] or [..., N, K], both float32 with any strides (a
transposed view is read in place), returns ``A @ B^T`` in float32, contiguous, batch dimensions broadcast as
``torch.matmul`` broadcasts them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families.base import SM90_SMEM_PER_BLOCK, Family, Knob
from kernelarc.families.matmul import _GROUPED_PID, _header, _tiled_kernel_src

PRECISIONS = ("bf16x3", "tf32x3", "bf16x6", "tf32")

_KERNEL = """

@triton.jit
def _split_dot(a, b, acc, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if PRECISION == "bf16x3":
        a_hi = a.to(tl.bfloat16)
        b_hi = b.to(tl.bfloat16)
        a_lo = (a - a_hi.to(tl.float32)).to(tl.bfloat16)
        b_lo = (b - b_hi.to(tl.float32)).to(tl.bfloat16)
        if UPCAST:  # the interpreter's bf16 dot is wrong; the parts are exact in fp32, so the sums are the MMA's
            a_hi, b_hi, a_lo, b_lo = a_hi.to(tl.float32), b_hi.to(tl.float32), a_lo.to(tl.float32), b_lo.to(tl.float32)
        acc = tl.dot(a_hi, b_lo, acc)  # the small terms first
        acc = tl.dot(a_lo, b_hi, acc)
        acc = tl.dot(a_hi, b_hi, acc)
    elif PRECISION == "tf32":
        acc = tl.dot(a, b, acc, input_precision="tf32")
    else:  # tf32x3, and bf16x6 in the in-kernel form (Triton's 3xTF32: the same 2**-21 class)
        acc = tl.dot(a, b, acc, input_precision="tf32x3")
    return acc


@triton.jit
def _mm_f32_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                   s_ab, s_am, s_ak, s_bb, s_bn, s_bk,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, INT64: tl.constexpr,
                   PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    batch = tl.program_id(1).to(tl.int64)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # rows past the edge read row 0 (never stored): no mask on the M/N sides
    rows_a = tl.where(offs_m < M, offs_m, 0)
    rows_b = tl.where(offs_n < N, offs_n, 0)
    offs_k = tl.arange(0, BLOCK_K)
    if INT64:
        rows_a = rows_a.to(tl.int64)
        rows_b = rows_b.to(tl.int64)
    a_ptrs = a_ptr + batch * s_ab + rows_a[:, None] * s_am + offs_k[None, :] * s_ak
    b_ptrs = b_ptr + batch * s_bb + rows_b[None, :] * s_bn + offs_k[:, None] * s_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = _split_dot(a, b, acc, PRECISION, UPCAST)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    if INT64:
        offs_m = offs_m.to(tl.int64)
        offs_n = offs_n.to(tl.int64)
    c_ptrs = c_ptr + batch * M * N + offs_m[:, None] * N + offs_n[None, :]
    tl.store(c_ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))
"""

# The split as data: each operand's parts laid side by side along K (zero-padded to KP per part), ordered so that
# one GEMM over the PARTS * KP columns sums exactly the products the precision keeps:
#   bf16x3: A [h, l, h] . B [l, h, h]                    = h.l + l.h + h.h
#   bf16x6: A [h, h, m, h, l, m] . B [h, m, h, l, h, m]  = h.h + h.m + m.h + h.l + l.h + m.m  (24 bits a side)
#   tf32x3: A [h, l, h] . B [l, h, h] in TF32-rounded fp32 (the tensor cores read TF32)
# The GEMM then reads K-major contiguous bf16 (or fp32) operands whatever the site's layout: the tensor cores' fast
# path, where the in-kernel split converts every tile in registers (on the H200: 0.2-0.45x SGEMM at 16384x1024x1024).
_PARTS = """

@triton.jit
def _tf32_round(x):
    # round to nearest TF32 (10 explicit mantissa bits): the value the tensor cores then read exactly
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def _split_parts(x_ptr, o_ptr, R, K, KP, s_r, s_k, SIDE_B: tl.constexpr, PARTS: tl.constexpr,
                 PRECISION: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    r64 = rows.to(tl.int64)[:, None]
    keep = (rows < R)[:, None] & (cols < KP)[None, :]
    x = tl.load(x_ptr + r64 * s_r + cols[None, :].to(tl.int64) * s_k, mask=keep & (cols < K)[None, :], other=0.0)
    o = o_ptr + r64 * (PARTS * KP) + cols[None, :]
    if PRECISION == "tf32x3":
        h = _tf32_round(x)
        lo = x - h
        tl.store(o, lo if SIDE_B else h, mask=keep)
        tl.store(o + KP, h if SIDE_B else lo, mask=keep)
        tl.store(o + 2 * KP, h, mask=keep)
    else:
        h = x.to(tl.bfloat16)
        r1 = x - h.to(tl.float32)
        m = r1.to(tl.bfloat16)
        if PRECISION == "bf16x3":
            tl.store(o, m if SIDE_B else h, mask=keep)
            tl.store(o + KP, h if SIDE_B else m, mask=keep)
            tl.store(o + 2 * KP, h, mask=keep)
        else:  # bf16x6: h, m, and the rest l
            lo = (r1 - m.to(tl.float32)).to(tl.bfloat16)
            tl.store(o, h, mask=keep)
            tl.store(o + KP, m if SIDE_B else h, mask=keep)
            tl.store(o + 2 * KP, h if SIDE_B else m, mask=keep)
            tl.store(o + 3 * KP, lo if SIDE_B else h, mask=keep)
            tl.store(o + 4 * KP, h if SIDE_B else lo, mask=keep)
            tl.store(o + 5 * KP, m, mask=keep)
"""

_CONCAT = '''

_NPARTS = {"tf32x3": 3, "bf16x3": 3, "bf16x6": 6}
CONCAT_MIN_MNK = 2**32  # on the H200: 512 x 1024 x 1024 ran 0.25x SGEMM with the parts, 0.9x split in the K loop
_SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 132


def _parts(X, side_b, kp):
    """X [R, K] (any strides) as its precision's parts side by side: [R, parts * kp], K-major, contiguous."""
    R, K = X.shape
    n = _NPARTS[PRECISION]
    dt = torch.float32 if PRECISION == "tf32x3" else torch.bfloat16
    out = torch.empty((R, n * kp), device=X.device, dtype=dt)
    grid = (triton.cdiv(R, 32), triton.cdiv(kp, 128))
    _split_parts[grid](X, out, R, K, kp, X.stride(0), X.stride(1), SIDE_B=side_b, PARTS=n, PRECISION=PRECISION,
                       BLOCK_R=32, BLOCK_C=128, num_warps=4)
    return out


def _concat_gemm(A2, B2):
    """A2 [M, K] @ B2 [N, K]^T in fp32 by one tensor-core GEMM over the operands' parts."""
    M, K = A2.shape
    N = B2.shape[0]
    C = torch.empty((M, N), device=A2.device, dtype=torch.float32)
    if PRECISION == "tf32":  # one product: the operands as they are, K-major
        X, Y, kk = A2.contiguous(), B2.contiguous(), K
    else:
        kp = triton.cdiv(K, 64) * 64
        X, Y = _parts(A2, False, kp), _parts(B2, True, kp)
        kk = X.shape[1]
    int64 = max(X.numel(), Y.numel(), C.numel()) >= 2**31
    tiles = triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N)
    # too few output tiles for the SMs (a weight gradient: 1024 x 1024 out of K = 16384): split K over programs
    # that add their fp32 partials into C (each split keeping at least 8 K steps)
    split = max(1, min(_SMS // tiles, kk // (8 * BLOCK_K), 16)) if tiles * 2 <= _SMS else 1
    per = triton.cdiv(triton.cdiv(kk, BLOCK_K), split) * BLOCK_K
    split = triton.cdiv(kk, per)
    kernel = matmul_kernel if split == 1 else matmul_kernel_splitk
    if split > 1:
        C.zero_()
    kernel[(tiles, split)](
        X, Y, C, M, N, kk, X.stride(0), Y.stride(0), N, 1, per, 0,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, SPLIT_K=split,
        EVEN_K=per % BLOCK_K == 0 and kk % per == 0, INT64=int64, UPCAST=INTERPRET, num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    return C
'''

_LAUNCHER = '''

def run(A, B):
    """A @ B^T in float32 for A [..., M, K] and B [N, K] or [..., N, K] (any strides, batch dims broadcast)."""
    if A.dtype != torch.float32 or B.dtype != torch.float32 or A.dim() < 2 or B.dim() < 2:
        raise ValueError(f"matmul_f32 takes float32 operands of rank >= 2, got {A.dtype} {tuple(A.shape)} "
                         f"and {B.dtype} {tuple(B.shape)}")
    M, K = A.shape[-2], A.shape[-1]
    N = B.shape[-2]
    if B.shape[-1] != K:
        raise ValueError(f"matmul_f32: inner dimensions differ: {tuple(A.shape)} @ {tuple(B.shape)}^T")
    if B.dim() == 2:  # a weight: every row of A against it, as one GEMM
        lead = tuple(A.shape[:-1])
        M = A.numel() // K if K else torch.Size(lead).numel()
        # the parts' pass costs a read and a write of both operands: worth it on large products only
        if M * N and K and (ALGO == "concat" or (ALGO == "auto" and M * N * K >= CONCAT_MIN_MNK)):
            return _concat_gemm(A.reshape(M, K), B).view(*lead, N)
        A3 = A.reshape(1, M, K)
        B3 = B.unsqueeze(0)
        batch = 1
    else:
        lead_b = torch.broadcast_shapes(tuple(A.shape[:-2]), tuple(B.shape[:-2]))
        lead = (*lead_b, M)
        A3 = A.expand(*lead_b, M, K).reshape(-1, M, K)
        B3 = B.expand(*lead_b, N, K).reshape(-1, N, K)
        batch = A3.shape[0]
    C = torch.empty((batch, M, N), device=A.device, dtype=torch.float32)
    if C.numel() == 0:
        return C.view(*lead, N)
    if K == 0:
        return C.zero_().view(*lead, N)
    # a broadcast batch (stride 0) is read in place; strides of 1 in K or in M/N are both served
    s_bb = B3.stride(0) if B3.shape[0] > 1 else 0
    int64 = max(A3.numel(), B3.numel(), M * N) >= 2**31 or max(
        abs(s) * d for s, d in zip((*A3.stride(), *B3.stride()), (*A3.shape, *B3.shape))) >= 2**31
    grid = (triton.cdiv(M, BLOCK_M) * triton.cdiv(N, BLOCK_N), batch)
    _mm_f32_kernel[grid](
        A3, B3, C, M, N, K,
        A3.stride(0), A3.stride(1), A3.stride(2), s_bb, B3.stride(1), B3.stride(2),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, GROUP_M=GROUP_M, EVEN_K=K % BLOCK_K == 0,
        INT64=int64, PRECISION=PRECISION, UPCAST=INTERPRET, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return C.view(*lead, N)
'''

_ELEM = 4  # fp32 operand bytes in shared memory


def _valid(k: Mapping[str, Any]) -> bool:
    bm, bn, bk, warps, stages = k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], k["num_warps"], k["num_stages"]
    # fp32 operand stages, plus (split precisions) the bf16 / tf32 hi and lo copies the MMAs read
    smem = max(stages - 1, 1) * (bm + bn) * bk * _ELEM + (bm + bn) * bk * _ELEM
    if smem > SM90_SMEM_PER_BLOCK - 1024:
        return False
    # the fp32 accumulator and the split operands held per thread
    regs = bm * bn / (32 * warps) + 2 * (bm + bn) * bk / (32 * warps)
    return regs < min(255, 65536 // (32 * warps)) - 32


def render(k: Mapping[str, Any]) -> str:
    names = ("PRECISION", "ALGO", "BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M")
    consts = "".join(f"{n} = {k[n]!r}\n" for n in names)
    consts += f"NUM_WARPS = {k['num_warps']!r}\nNUM_STAGES = {k['num_stages']!r}\n"
    # the bf16 family's tiled GEMM run on the parts, and its split-K form adding fp32 partials atomically
    gemm = _tiled_kernel_src("pointer", 1, "partials")
    gemm += _tiled_kernel_src("pointer", 2, "atomic").replace("def matmul_kernel(", "def matmul_kernel_splitk(")
    return _header(FAMILY_NAME, k) + "\n" + consts + _GROUPED_PID + _KERNEL + gemm + _PARTS + _CONCAT + _LAUNCHER


FAMILY_NAME = "matmul_f32.split"

SPLIT = Family(
    name=FAMILY_NAME,
    task="matmul_f32",
    description="float32 GEMM on tensor cores: operands split into high and low parts (3 bf16 or TF32 products) "
    "or one TF32 product; any strides, batched",
    knobs=(
        Knob("PRECISION", PRECISIONS, "precision", "bf16x3 / tf32x3 / bf16x6 split products or one TF32 product"),
        Knob(
            "ALGO",
            ("auto", "concat", "inline"),
            "algorithmic",
            "weight GEMMs: the parts written side by side along K, then one tensor-core GEMM; or split in the K loop; "
            "auto: the parts from M*N*K of 2**32 on",
        ),
        Knob("BLOCK_M", (128, 64, 256), "tiling", "output tile rows"),
        Knob("BLOCK_N", (128, 64, 256), "tiling", "output tile columns"),
        Knob("BLOCK_K", (32, 16, 64), "tiling", "K step per iteration"),
        Knob("GROUP_M", (8, 1, 4, 16), "scheduling", "row blocks sharing a column sweep (L2 reuse of B)"),
        Knob("num_warps", (8, 4), "scheduling", "warps per program"),
        Knob("num_stages", (3, 2, 4), "memory", "pipelined operand loads in flight"),
    ),
    start={
        "PRECISION": "bf16x3",
        "ALGO": "auto",
        "BLOCK_M": 128,
        "BLOCK_N": 128,
        "BLOCK_K": 32,
        "GROUP_M": 8,
        "num_warps": 8,
        "num_stages": 3,
    },
    render=render,
    valid=_valid,
    dtypes=("float32",),
)

FAMILIES = [SPLIT]
