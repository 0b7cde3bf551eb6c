"""CUTLASS Hopper attention-forward families for ``attention`` and ``attention_residual`` (language
``cutlass``; for the second, the residual is added in place on the kernel's output, or in its epilogue:
see the ``RESIDUAL`` knob).

The C++ lives in ``templates/cutlass/fmha_sm90.cu.in`` and instantiates CUTLASS's
``examples/88_hopper_fmha`` kernel (shipped in the nvidia-cutlass wheel): the FlashAttention-3
structure the Triton family cannot express on Triton 3.6 -- a TMA producer warpgroup feeding
two consumer warpgroups (cooperative on one Q tile, or ping-pong over two with a persistent
scheduler so one's softmax overlaps the other's wgmma), online softmax in exp2, and causal
block skipping. One built library holds the dense and the causal kernel, and a dense kernel that masks
the last K/V tile's keys past S (for S not a multiple of ``BLOCK_KV``); the library picks by the
``causal`` input and S.

Scope: bf16, head dim 128, sequence length a multiple of 8 (16-byte TMA rows); other inputs
get a clear error. Grouped-query attention (fewer K/V heads) is served by repeating K and V
to the query heads first (correct, but it adds that copy to the time).

Feasibility (``valid``): the kernel's shared memory (``smem_bytes``: Q, ``STAGES_KV`` K/V tiles,
the epilogue's buffers when persistent) fits the 227 KB an sm_90 block can have; ping-pong is always
persistent. 256-key tiles (one of CUTLASS's own head-dim-128 configurations) fit only with 3 stages,
non-persistent.
"""

from __future__ import annotations

import dataclasses
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kernelarc.families.base import SM90_SMEM_PER_BLOCK, Family, Knob, cutlass_candidate_head, offered_on_gpu

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "cutlass" / "fmha_sm90.cu.in"
SMEM_LIMIT = SM90_SMEM_PER_BLOCK
_BARRIERS = 512
_EPILOGUE_BESIDE = 17408
HEAD_DIM = 128
ELEM = 2  # bf16

_SCHEDULES = {
    "cooperative": "cutlass::gemm::KernelTmaWarpSpecializedCooperative",
    "pingpong": "cutlass::gemm::KernelTmaWarpSpecializedPingpong",
}


_IN_EPILOGUE = ("epilogue", "prefetch", "stage")  # RESIDUAL values that pass the residual to the kernel
_IN_MAINLOOP = ("prefetch", "stage")  # ... and to its mainloop, which starts bringing it in


def render_cpp(k: Mapping[str, Any]) -> str:
    fused = k.get("RESIDUAL") in _IN_EPILOGUE
    options = [f"Option<Tag::kStagesKV, Int<{k['STAGES_KV']}>>"]
    if k["PERSISTENT"] and k["SCHEDULE"] == "cooperative":  # ping-pong adds it itself
        options.append("Option<Tag::kIsPersistent, true_type>")
    if k["ORDER_SOFTMAX"]:  # the consumer warpgroups take turns at softmax (FA3's inter-warpgroup ping-pong)
        options.append("Option<Tag::kIsMainloopLocked, true_type>")
    if fused and k["SCHEDULE"] == "pingpong":
        # the template composes the kernel itself here, so it adds what FmhaBuilder adds for ping-pong
        options += ["Option<Tag::kIsPersistent, true_type>", "Option<Tag::kLoadsQSeparately, true_type>"]
    return string.Template(TEMPLATE.read_text()).substitute(
        BLOCK_Q=k["BLOCK_Q"],
        BLOCK_KV=k["BLOCK_KV"],
        KERNEL_SCHEDULE=_SCHEDULES[k["SCHEDULE"]],
        OPTIONS="".join(", " + o for o in options),
        RESIDUAL_EPILOGUE=int(fused),
        RESIDUAL_PREFETCH=int(k.get("RESIDUAL") in _IN_MAINLOOP),
        RESIDUAL_STAGE=int(k.get("RESIDUAL") == "stage"),
    )


def _render(family: Family, knobs: Mapping[str, Any], residual: bool) -> str:
    k = family.check_point(knobs)
    signature = "q, k, v, residual, causal" if residual else "q, k, v, causal"
    what = "softmax(q k^T / sqrt(D)) v + residual" if residual else "softmax(q k^T / sqrt(D)) v"
    fused = k.get("RESIDUAL") in _IN_EPILOGUE
    inputs = "[q, k, v, _aligned(residual.to(torch.bfloat16))]" if fused else "[q, k, v]"
    check = (
        '\n    if residual.shape != q.shape:\n        raise ValueError("the residual must have the shape of q")'
        if fused else ""
    )  # fmt: skip
    # RESIDUAL=after: added in place on the kernel's output (one extra pass over o); =epilogue: the
    # kernel's epilogue added it to the accumulator before storing o (=prefetch: from L2, where the
    # kernel asked for it before its mainloop; =stage: from shared memory, where each thread copied its
    # own values before its mainloop)
    finish = "    return o.add_(residual)\n" if residual and not fused else "    return o\n"
    return (
        cutlass_candidate_head(family.name, k, render_cpp(k))
        + f"""

def _aligned(t):
    # contiguous, and 16-byte aligned as TMA (and the epilogue's paired residual loads) need: a view
    # into a larger tensor may start anywhere
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def run({signature}):
    # {what} per (batch, head), q/k/v/o as [B, H, S, D] bf16
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    if q.dtype != torch.bfloat16 or k.dtype != torch.bfloat16 or v.dtype != torch.bfloat16:
        raise ValueError("this CUTLASS attention takes bf16 q, k, v")
    if D != {HEAD_DIM} or S % 8 or k.shape[2] != S:
        raise ValueError("this CUTLASS attention is built for head dim {HEAD_DIM}, self-attention, S a multiple of 8")
    if Hkv != H:
        # grouped-query attention: each K/V head serves H // Hkv query heads
        k = k.repeat_interleave(H // Hkv, dim=1)
        v = v.repeat_interleave(H // Hkv, dim=1)
    q, k, v = (_aligned(t) for t in (q, k, v)){check}
    o = torch.empty_like(q)
    lse = torch.empty((B, H, S), device=q.device, dtype=torch.float32)
    if B * H * S == 0:
        return o{" + residual" if fused else ""}
    _KERNEL({inputs}, [o, lse], [B, H, S, D, 1 if causal else 0])
{finish}"""
    )


def render(knobs: Mapping[str, Any]) -> str:
    return _render(CUTLASS_FMHA, knobs, residual=False)


def render_residual(knobs: Mapping[str, Any]) -> str:
    return _render(CUTLASS_FMHA_RESIDUAL, knobs, residual=True)


def smem_bytes(k: Mapping[str, Any]) -> int:
    """Shared memory of the kernel at ``k``: ``sizeof(Kernel::SharedStorage)`` of CUTLASS 4.2's example,
    modelled exactly (checked against nvcc by tests/families/test_cutlass_fmha_family.py).

    Q: two stages of a half tile (one per consumer warpgroup), BLOCK_Q x D in all; K and V share
    STAGES_KV stages of BLOCK_KV x D; pipeline barriers 512 bytes. A persistent kernel (ping-pong is
    always persistent) keeps the epilogue's store buffers beside the mainloop's instead of in a union
    with them: 17408 bytes more. ``RESIDUAL=stage`` adds the residual's slots, a BLOCK_Q x D bf16 tile
    (static shared memory, beside ``SharedStorage``).
    """
    q = k["BLOCK_Q"] * HEAD_DIM * ELEM
    kv = k["STAGES_KV"] * k["BLOCK_KV"] * HEAD_DIM * ELEM
    persistent = k["PERSISTENT"] or k["SCHEDULE"] == "pingpong"
    staged = k["BLOCK_Q"] * HEAD_DIM * ELEM if k.get("RESIDUAL") == "stage" else 0
    return q + kv + _BARRIERS + (_EPILOGUE_BESIDE if persistent else 0) + staged


def valid(k: Mapping[str, Any]) -> bool:
    return smem_bytes(k) <= SMEM_LIMIT


def available() -> bool:
    from kernelarc import cutlass

    if not cutlass.available():
        return False
    return any(
        (Path(d) / "88_hopper_fmha" / "kernel" / "fmha_kernel_builder.hpp").is_file() for d in cutlass.include_dirs()
    )


CUTLASS_FMHA = Family(
    name="attention.cutlass_fmha_sm90",
    task="attention",
    description="CUTLASS Hopper FMHA (FA3-style): TMA producer + wgmma consumer warpgroups, cooperative/ping-pong",
    knobs=(
        Knob("BLOCK_Q", (128,), "tiling", "query rows per CTA tile (64 per consumer warpgroup)"),
        Knob("BLOCK_KV", (64, 128, 256), "tiling", "keys per mainloop step"),
        Knob("SCHEDULE", ("cooperative", "pingpong"), "scheduling", "consumer warpgroups share a Q tile or alternate"),
        Knob("PERSISTENT", (False, True), "scheduling", "persistent tile scheduler (ping-pong always is)"),
        # 2 stages left out: that point hung on the H200 after building (2026-11-30, BENCHMARKS.md)
        Knob("STAGES_KV", (3, 4, 5, 6, 7, 8), "scheduling", "K/V pipeline stages in shared memory"),
        Knob("ORDER_SOFTMAX", (False, True), "scheduling", "consumer warpgroups take turns at softmax (barrier)"),
    ),
    # CUTLASS's example default for head dim 128 (its "tma ws cooperative 128x128x128")
    start={
        "BLOCK_Q": 128,
        "BLOCK_KV": 128,
        "SCHEDULE": "cooperative",
        "PERSISTENT": False,
        "STAGES_KV": 5,
        "ORDER_SOFTMAX": False,
    },
    render=render,
    valid=valid,
    language="cutlass",
)

# attention + residual: the same kernel, the residual added to its output
CUTLASS_FMHA_RESIDUAL = dataclasses.replace(
    CUTLASS_FMHA,
    name="attention_residual.cutlass_fmha_sm90",
    task="attention_residual",
    description="CUTLASS Hopper FMHA (FA3-style) with the residual added in its epilogue or after it",
    knobs=(
        *CUTLASS_FMHA.knobs,
        Knob(
            "RESIDUAL",
            ("after", "epilogue", "prefetch", "stage"),
            "fusion",
            "residual added in place after the kernel, or to the accumulator before the store "
            "(prefetch: its tile brought into L2 before the mainloop; stage: each thread's residual values copied "
            "into shared memory before the mainloop)",
        ),
    ),  # fmt: skip
    start={**CUTLASS_FMHA.start, "RESIDUAL": "after"},
    render=render_residual,
)


FAMILIES = [CUTLASS_FMHA, CUTLASS_FMHA_RESIDUAL] if offered_on_gpu(available) else []
