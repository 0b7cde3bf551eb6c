"""Shared renderer of the FlashAttention forward families (``attention`` and
``attention_residual`` tasks). Not a family module itself (leading underscore).

Task: ``run(q, k, v, causal)`` (or ``run(q, k, v, residual, causal)``; a composition may pass ``key_bias``, an
additive bias per batch row and key, [B or 1, S], for a key-padding mask) with q [B, H, S, D],
k and v [B, Hkv, S, D] bf16 contiguous, H % Hkv == 0 (head h reads kv head h // (H // Hkv)),
``causal`` 0/1 with the top-left aligned mask (query i sees keys j <= i), scale 1/sqrt(D).

Kernel design (FlashAttention-2 forward, Hopper-minded):

* one program per (BLOCK_M query rows, batch*head); q stays on chip for the whole loop;
* online softmax in base 2: log2(e)/sqrt(D) is folded into one FMA per score
  (``SCALE="scores"``) or into q once before the loop (``SCALE="q"``);
* the key loop is split into blocks that need no mask (fully below the diagonal, or before
  the sequence tail) and the few masked blocks (the diagonal, or the tail), so causal runs
  skip every block above the diagonal and pay for masks only where needed;
* GQA by head index mapping (no K/V copies);
* K/V (and q) loaded through pointers or TMA tensor descriptors; pipelined by num_stages;
* the residual add (attention_residual) is fused into the epilogue.

No warp-specialization knob: with Triton 3.6 on sm_90a the only form that compiles (one
key loop, TMA loads, 4 warps) deadlocked on the H200 (NOTES_compute.md).

Under ``TRITON_INTERPRET=1`` the kernel upcasts operands to fp32 (bf16 arithmetic is wrong
in Triton's interpreter).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families.base import SM90_SMEM_PER_BLOCK, Family, Knob

SMEM_LIMIT = SM90_SMEM_PER_BLOCK  # bytes per block on H100/H200
SMEM_SLACK = 1024
MAX_HEAD_DIM = 128  # largest D on the GPU workloads: valid() must hold for it

KNOBS = (
    Knob("BLOCK_M", (16, 32, 64, 128, 256), "tiling", "query rows per program"),
    Knob("BLOCK_N", (16, 32, 64, 128, 256), "tiling", "keys per inner step"),
    Knob("num_warps", (2, 4, 8, 16), "scheduling", "warps per program"),
    Knob("num_stages", (1, 2, 3, 4, 5, 6), "scheduling", "K/V software-pipeline depth"),
    Knob("MEMORY", ("pointer", "tma"), "memory", "q/K/V loads through pointers or TMA descriptors"),
    Knob("SCALE", ("scores", "q"), "precision", "fold log2(e)/sqrt(D) into each score or into q once"),
    Knob("M_ORDER", ("forward", "reverse"), "scheduling", "query-block launch order (reverse: long causal rows first)"),
    Knob("GRID_ORDER", ("m_fastest", "heads_fastest"), "scheduling", "which grid axis walks query blocks"),
    Knob(
        "LOOP",
        ("split", "single"),
        "algorithmic",
        "split: unmasked blocks, then the masked diagonal/tail blocks; single: one loop masking every block",
    ),
)

START = {
    "BLOCK_M": 64,
    "BLOCK_N": 64,
    "num_warps": 4,
    "num_stages": 2,
    "MEMORY": "pointer",
    "SCALE": "scores",
    "M_ORDER": "forward",
    "GRID_ORDER": "m_fastest",
    "LOOP": "split",
}


def _uses_wgmma(k: Mapping[str, Any]) -> bool:
    # Triton 3.6 uses wgmma when a warpgroup can own 64-row slabs (AOT sweep)
    return k["BLOCK_M"] >= 64 and k["num_warps"] >= 4


def smem_estimate(k: Mapping[str, Any], head_dim: int = MAX_HEAD_DIM) -> int:
    """q tile once, K and V tiles num_stages deep (bytes); calibrated on sm_90a compiles."""
    bm, bn, stages = k["BLOCK_M"], k["BLOCK_N"], max(k["num_stages"], 1)
    return bm * head_dim * 2 + 2 * stages * bn * head_dim * 2


def regs_estimate(k: Mapping[str, Any], head_dim: int = MAX_HEAD_DIM) -> float:
    """32-bit registers per thread: fp32 accumulator, fp32 scores, bf16 probabilities, and
    q when it is an mma.sync register operand (no wgmma)."""
    bm, bn, warps = k["BLOCK_M"], k["BLOCK_N"], k["num_warps"]
    regs = bm * head_dim + bm * bn + bm * bn / 2
    if not _uses_wgmma(k):
        regs += bm * head_dim / 2
    return regs / (32 * warps)


def valid(k: Mapping[str, Any]) -> bool:
    if smem_estimate(k) > SMEM_LIMIT - SMEM_SLACK:
        return False
    # measured (AOT sweep): kernels use about 64-90 registers beyond this estimate; the cap
    # is 255 per thread, and 65536 / threads when that is lower (16 warps: 128)
    return regs_estimate(k) + 64 <= min(255, 65536 // (32 * k["num_warps"]))


_SRC = '''"""KernelArc candidate rendered by kernel family {family}.

Knobs: {knobs}
"""

import math
import os

import torch
import triton
import triton.language as tl
{extra_imports}
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

BLOCK_M = {BLOCK_M}
BLOCK_N = {BLOCK_N}
NUM_WARPS = {num_warps}
NUM_STAGES = {num_stages}
USE_TMA = {use_tma}
SCALE_Q = {scale_q}
M_REVERSE = {m_reverse}
HEADS_FASTEST = {heads_fastest}
SINGLE_LOOP = {single_loop}
LOG2E = 1.4426950408889634


@triton.jit
def _attn_loop(acc, l_i, m_i, q, k_src, v_src, kb_src, kv_row0, lo, hi, offs_m, seq_len, qk_scale,
               MASK: tl.constexpr, MASK_LOADS: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, TMA: tl.constexpr, SCALE_Q: tl.constexpr,
               UPCAST: tl.constexpr, KEY_BIAS: tl.constexpr, Q_SCALED: tl.constexpr):
    # SCALE_Q: the scores come out of the product already in base-2 units (q scaled, or a key bias added below)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    for start_n in tl.range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        if TMA:
            k = k_src.load([kv_row0 + start_n, 0])
        else:
            kv_offs = cols[:, None] * HEAD_DIM + offs_d[None, :]
            if MASK_LOADS:
                k = tl.load(k_src + kv_offs, mask=cols[:, None] < seq_len, other=0.0)
            else:
                k = tl.load(k_src + kv_offs)
        if UPCAST:
            k = k.to(tl.float32)
        qk = tl.dot(q, k.T)
        if KEY_BIAS:
            # one additive bias per key (a padding mask), in base-2 units and at least -1e30 (a score plus it is
            # -1e30, as fp32 finfo.min plus a score is finfo.min; with -inf a block of masked keys before any kept one
            # would give NaN); keys outside the causal mask or the sequence stay below it (-3e38), so a row whose
            # visible keys are all padded averages them, as the reference does, and never reads a future key
            kb = tl.load(kb_src + cols, mask=cols < seq_len, other=0.0)
            if Q_SCALED:
                qk = qk + kb[None, :]
            else:
                qk = qk * qk_scale + kb[None, :]
        if MASK:
            keep = cols[None, :] < seq_len
            if CAUSAL:
                keep = keep & (offs_m[:, None] >= cols[None, :])
            if SCALE_Q:
                s = tl.where(keep, qk, -3.0e38)
            else:
                s = tl.where(keep, qk * qk_scale, -3.0e38)
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            s = s - m_ij[:, None]
        else:
            if SCALE_Q:
                m_ij = tl.maximum(m_i, tl.max(qk, 1))
                s = qk - m_ij[:, None]
            else:
                m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
                s = qk * qk_scale - m_ij[:, None]
        p = tl.math.exp2(s)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if TMA:
            v = v_src.load([kv_row0 + start_n, 0])
        else:
            if MASK_LOADS:
                v = tl.load(v_src + kv_offs, mask=cols[:, None] < seq_len, other=0.0)
            else:
                v = tl.load(v_src + kv_offs)
        if UPCAST:
            v = v.to(tl.float32)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_ij
    return acc, l_i, m_i


@triton.jit
def attn_fwd_kernel(q_src, k_src, v_src, r_ptr, kb_ptr, o_ptr, qk_scale, seq_len, H, HKV,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    CAUSAL: tl.constexpr, EVEN_N: tl.constexpr, SINGLE_LOOP: tl.constexpr,
                    M_REVERSE: tl.constexpr, HEADS_FASTEST: tl.constexpr,
                    TMA: tl.constexpr, SCALE_Q: tl.constexpr, RESIDUAL: tl.constexpr,
                    UPCAST: tl.constexpr, KEY_BIAS: tl.constexpr):
    # a Python float argument is an fp32 scalar when Triton launches the kernel, fp64 when Inductor calls it from
    # a compiled graph (trace_kernels): fp64 would promote every score and change the loop-carried types
    qk_scale = tl.full([], qk_scale, tl.float32)
    if HEADS_FASTEST:
        pid_m = tl.program_id(1)
        off_bh = tl.program_id(0)
        num_m = tl.num_programs(1)
    else:
        pid_m = tl.program_id(0)
        off_bh = tl.program_id(1)
        num_m = tl.num_programs(0)
    if M_REVERSE:
        start_m = num_m - 1 - pid_m
    else:
        start_m = pid_m
    off_b = off_bh // H
    off_h = off_bh % H
    # GQA: query head h reads kv head h // (H // HKV); rows of the flattened [B*H*S, D] tensors
    kv_row0 = (off_b * HKV + off_h // (H // HKV)) * seq_len
    q_row0 = off_bh * seq_len
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    row_mask = offs_m[:, None] < seq_len
    io_offs = (q_row0.to(tl.int64) + offs_m)[:, None] * HEAD_DIM + offs_d[None, :]
    if TMA:
        q = q_src.load([q_row0 + start_m * BLOCK_M, 0])
    else:
        q = tl.load(q_src + io_offs, mask=row_mask, other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    if TMA:
        k_base = k_src
        v_base = v_src
        kv_coord = kv_row0  # TMA row coordinate of this kv head
    else:
        k_base = k_src + kv_row0.to(tl.int64) * HEAD_DIM  # 64-bit head offset, 32-bit in-loop
        v_base = v_src + kv_row0.to(tl.int64) * HEAD_DIM
        kv_coord = 0
    if SCALE_Q:
        q = (q.to(tl.float32) * qk_scale).to(q.dtype)
    if KEY_BIAS:
        kb_base = kb_ptr + off_b.to(tl.int64) * seq_len  # this batch's row of the [B, S] key bias
    else:
        kb_base = kb_ptr
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    if CAUSAL:
        # blocks entirely left of the diagonal need no mask; the rest up to the diagonal do,
        # and blocks right of it are skipped
        hi_full = (start_m * BLOCK_M) // BLOCK_N * BLOCK_N
        hi_mask = tl.minimum((start_m + 1) * BLOCK_M, seq_len)
    else:
        hi_full = seq_len // BLOCK_N * BLOCK_N
        hi_mask = seq_len
    if SINGLE_LOOP:
        # one loop that masks every block (fewer loops to pipeline, more mask arithmetic)
        acc, l_i, m_i = _attn_loop(acc, l_i, m_i, q, k_base, v_base, kb_base, kv_coord, 0, hi_mask, offs_m,
                                   seq_len, qk_scale, CAUSAL or not EVEN_N, not EVEN_N, CAUSAL,
                                   BLOCK_N, HEAD_DIM, TMA, SCALE_Q or KEY_BIAS, UPCAST, KEY_BIAS, SCALE_Q)
    else:
        acc, l_i, m_i = _attn_loop(acc, l_i, m_i, q, k_base, v_base, kb_base, kv_coord, 0, hi_full, offs_m,
                                   seq_len, qk_scale, False, False, CAUSAL, BLOCK_N, HEAD_DIM, TMA,
                                   SCALE_Q or KEY_BIAS, UPCAST, KEY_BIAS, SCALE_Q)
        if CAUSAL or not EVEN_N:
            acc, l_i, m_i = _attn_loop(acc, l_i, m_i, q, k_base, v_base, kb_base, kv_coord, hi_full, hi_mask,
                                       offs_m, seq_len, qk_scale, True, True, CAUSAL, BLOCK_N,
                                       HEAD_DIM, TMA, SCALE_Q or KEY_BIAS, UPCAST, KEY_BIAS, SCALE_Q)
    acc = acc / l_i[:, None]
    if RESIDUAL:
        acc += tl.load(r_ptr + io_offs, mask=row_mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + io_offs, acc.to(o_ptr.dtype.element_ty), mask=row_mask)


def _attention(q, k, v, residual, causal, key_bias=None):
    # key_bias: None, or an fp32 [B, S] bias added to every query's score of each key (natural-log units; -inf for
    # a masked key), as a key-padding mask is
    B, H, S, D = q.shape
    HKV = k.shape[1]
    q = q.contiguous()
    k = k.contiguous()
    v = v.contiguous()
    o = torch.empty_like(q)
    if residual is not None:
        residual = residual.contiguous()
    qk_scale = LOG2E / math.sqrt(D)
    if key_bias is not None:
        key_bias = (key_bias.to(torch.float32) * LOG2E).clamp_min(-1.0e30).expand(B, S).contiguous()
    num_m = triton.cdiv(S, BLOCK_M)
    grid = (B * H, num_m) if HEADS_FASTEST else (num_m, B * H)
    if USE_TMA:
        q_arg = TensorDescriptor(q, [B * H * S, D], [D, 1], [BLOCK_M, D])
        k_arg = TensorDescriptor(k, [B * HKV * S, D], [D, 1], [BLOCK_N, D])
        v_arg = TensorDescriptor(v, [B * HKV * S, D], [D, 1], [BLOCK_N, D])
    else:
        q_arg, k_arg, v_arg = q, k, v
    attn_fwd_kernel[grid](
        q_arg, k_arg, v_arg, residual, key_bias, o, qk_scale, S, H, HKV,
        HEAD_DIM=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, CAUSAL=bool(causal), EVEN_N=S % BLOCK_N == 0,
        SINGLE_LOOP=SINGLE_LOOP, M_REVERSE=M_REVERSE,
        HEADS_FASTEST=HEADS_FASTEST, TMA=USE_TMA, SCALE_Q=SCALE_Q, RESIDUAL=residual is not None,
        UPCAST=INTERPRET, KEY_BIAS=key_bias is not None,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )
    return o
'''

_RUN_PLAIN = """

def run(q, k, v, causal, key_bias=None):
    return _attention(q, k, v, None, causal, key_bias)
"""

_RUN_RESIDUAL = """

def run(q, k, v, residual, causal):
    return _attention(q, k, v, residual, causal)
"""


def render(family: Family, knobs: Mapping[str, Any], residual: bool) -> str:
    k = family.check_point(knobs)
    tma = k["MEMORY"] == "tma"
    src = _SRC.format(
        family=family.name,
        knobs=", ".join(f"{n}={k[n]!r}" for n in sorted(k)),
        extra_imports="from triton.tools.tensor_descriptor import TensorDescriptor\n" if tma else "",
        BLOCK_M=k["BLOCK_M"],
        BLOCK_N=k["BLOCK_N"],
        num_warps=k["num_warps"],
        num_stages=k["num_stages"],
        use_tma=tma,
        scale_q=k["SCALE"] == "q",
        m_reverse=k["M_ORDER"] == "reverse",
        heads_fastest=k["GRID_ORDER"] == "heads_fastest",
        single_loop=k["LOOP"] == "single",
    )
    return src + (_RUN_RESIDUAL if residual else _RUN_PLAIN)


def make_family(name: str, task: str, residual: bool, description: str) -> Family:
    fam: Family

    def _render(knobs: Mapping[str, Any]) -> str:
        return render(fam, knobs, residual)

    fam = Family(
        name=name,
        task=task,
        description=description,
        knobs=KNOBS,
        start=dict(START),
        render=_render,
        valid=valid,
    )
    return fam


_D16 = [["tt.divisibility", 16]]


def aot_jobs(
    family: Family, knobs: Mapping[str, Any], head_dim: int = 128, causal: bool = True, residual: bool = False
) -> list[dict]:
    """How the launcher specializes ``attn_fwd_kernel`` for a GPU shape (S=4096, H=32)."""
    k = family.check_point(knobs)
    tma = k["MEMORY"] == "tma"
    if tma:
        sig = {
            "q_src": f"tensordesc<bf16[{k['BLOCK_M']},{head_dim}]>",
            "k_src": f"tensordesc<bf16[{k['BLOCK_N']},{head_dim}]>",
            "v_src": f"tensordesc<bf16[{k['BLOCK_N']},{head_dim}]>",
        }
    else:
        sig = {"q_src": "*bf16", "k_src": "*bf16", "v_src": "*bf16"}
    sig["r_ptr"] = "*bf16" if residual else "constexpr"
    sig["kb_ptr"] = "constexpr"
    sig.update({"o_ptr": "*bf16", "qk_scale": "fp32", "seq_len": "i32", "H": "i32", "HKV": "i32"})
    consts: dict[str, Any] = {} if residual else {"r_ptr": None}
    consts["kb_ptr"] = None
    consts.update(
        {
            "HEAD_DIM": head_dim,
            "BLOCK_M": k["BLOCK_M"],
            "BLOCK_N": k["BLOCK_N"],
            "CAUSAL": causal,
            "EVEN_N": True,
            "SINGLE_LOOP": k["LOOP"] == "single",
            "M_REVERSE": k["M_ORDER"] == "reverse",
            "HEADS_FASTEST": k["GRID_ORDER"] == "heads_fastest",
            "TMA": tma,
            "SCALE_Q": k["SCALE"] == "q",
            "RESIDUAL": residual,
            "UPCAST": False,
            "KEY_BIAS": False,
        }
    )
    for n in consts:
        sig[n] = "constexpr"
    names = list(sig)
    attrs = {
        (names.index(n),): _D16
        for n in ("q_src", "k_src", "v_src", "r_ptr", "o_ptr", "seq_len", "H", "HKV")
        if sig[n] in ("*bf16", "i32")
    }
    opts = {"num_warps": k["num_warps"], "num_stages": k["num_stages"]}
    return [dict(kernel="attn_fwd_kernel", signature=sig, constexprs=consts, attrs=attrs, options=opts)]
