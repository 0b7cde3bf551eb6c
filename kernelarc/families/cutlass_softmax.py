"""Hopper row-softmax family for the ``softmax`` task (language ``cutlass``: CUDA C++ on CUTLASS's
barrier and bulk-copy primitives, built through :mod:`kernelarc.cutlass`).

Why it exists: the Triton families cannot hold a 64 KB row (softmax at N = 32768, bf16) anywhere
but registers, so they either keep one row per SM in registers (the load, reductions and store of a
row do not overlap) or read every row twice (BENCHMARKS.md: 56-75% of copy). This kernel stages
whole rows in shared memory instead: persistent CTAs, ``STAGES`` tiles of rows in flight per CTA,
each tile brought by one ``cp.async.bulk`` (TMA bulk copy, completion on an mbarrier), reduced and
normalised from shared memory, and written by vector stores or a bulk copy back out. Every byte
is read from DRAM once and written once.

The C++ is ``templates/cutlass/softmax_sm90.cu.in``. Rows that are not 16-byte multiples or that
are larger than a stage go to a plain global-memory kernel in the same library (any N, slower).

Feasibility (``valid``): the fp16 exp cache goes with two-pass statistics; the stages fit the shared
memory of an SM shared by ``CTAS_PER_SM`` CTAs (227 KB per CTA at most); the CTAs' threads are at
most 1536 per SM, so ptxas may give each thread 40 registers, what the kernel needs (2048 threads cap
it at 32, and it spills 20-64 bytes: seen at the build).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kernelarc.cutlass import available  # nvcc and the CUTLASS headers: all this family needs to build
from kernelarc.families.base import (
    SM90_SMEM_PER_BLOCK,
    SM90_SMEM_PER_SM,
    Family,
    Knob,
    cutlass_candidate_head,
    offered_on_gpu,
)

TEMPLATE = Path(__file__).resolve().parents[2] / "templates" / "cutlass" / "softmax_sm90.cu.in"
CTA_RESERVED = 1024  # the runtime reserves 1 KB of shared memory per resident CTA
THREADS_PER_SM = 1536  # of the SM's 2048: ptxas may then give each thread 40 registers
_SCRATCH = 1024  # mbarriers and reduction slots after the stages (sizeof(Shared) <= 1 KB)
_STORES = {"st": 0, "st_cs": 1, "bulk": 2}


def smem_bytes(k: Mapping[str, Any]) -> int:
    return k["STAGES"] * k["STAGE_KB"] * 1024 + _SCRATCH


def _cpp_bool(flag: bool) -> str:
    return "true" if flag else "false"


def render_cpp(k: Mapping[str, Any]) -> str:
    return string.Template(TEMPLATE.read_text()).substitute(
        THREADS=k["THREADS"],
        STAGES=k["STAGES"],
        STAGE_KB=k["STAGE_KB"],
        CTAS_PER_SM=k["CTAS_PER_SM"],
        ELEMS_PER_THREAD=k["ELEMS_PER_THREAD"],
        STORE=_STORES[k["STORE"]],
        EXP2=_cpp_bool(k["EXP"] == "exp2"),
        MUL_RCP=_cpp_bool(k["NORMALIZE"] == "mul_rcp"),
        EVICT_FIRST=_cpp_bool(k["LOAD_HINT"] == "evict_first"),
        ONLINE=_cpp_bool(k["STATS"] == "online"),
        UNROLL=k["UNROLL"],
        EXP_CACHE=_cpp_bool(k["EXP_CACHE"] == "fp16"),
    )


def render(knobs: Mapping[str, Any]) -> str:
    k = CUTLASS_SOFTMAX.check_point(knobs)
    return (
        cutlass_candidate_head(CUTLASS_SOFTMAX.name, k, render_cpp(k))
        + """

def run(x):
    # y = softmax(x) over the last dim, fp32 math, bf16 in and out
    if x.dtype != torch.bfloat16 or x.dim() != 2:
        raise ValueError("this CUTLASS softmax takes a 2-D bf16 tensor")
    x = x.contiguous()
    if x.data_ptr() % 16:
        x = x.clone()  # a view may start anywhere; the bulk copies need 16-byte aligned rows
    M, N = x.shape
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0 or N == 0:
        return y
    _KERNEL([x], [y], [M, N])
    return y
"""
    )


def valid(k: Mapping[str, Any]) -> bool:
    if k["EXP_CACHE"] != "none" and k["STATS"] != "two_pass":
        return False  # the cached exp must be taken against the row's final max
    smem = smem_bytes(k)
    if smem > SM90_SMEM_PER_BLOCK:
        return False
    if k["CTAS_PER_SM"] * (smem + CTA_RESERVED) > SM90_SMEM_PER_SM:
        return False
    return k["CTAS_PER_SM"] * k["THREADS"] <= THREADS_PER_SM


CUTLASS_SOFTMAX = Family(
    name="softmax.cutlass_sm90",
    task="softmax",
    description="Hopper softmax: persistent CTAs, rows staged in shared memory by TMA bulk copies, one DRAM read",
    knobs=(
        Knob("THREADS", (256, 512, 1024), "scheduling", "threads per CTA"),
        Knob("STAGES", (1, 2, 3, 4, 6), "scheduling", "row tiles in flight per CTA (shared-memory buffers)"),
        Knob("STAGE_KB", (16, 32, 48, 64, 96), "tiling", "bytes of rows per tile (rows larger than this go plain)"),
        Knob("CTAS_PER_SM", (1, 2, 3, 4), "scheduling", "persistent CTAs per SM (they share its shared memory)"),
        Knob("ELEMS_PER_THREAD", (8, 16, 32, 64, 128), "tiling", "elements per thread of a row: sets threads per row"),
        Knob("UNROLL", (1, 2, 4), "scheduling", "unroll of the per-thread vector loops (loads in flight)"),
        Knob(
            "STATS",
            ("two_pass", "online"),
            "algorithmic",
            "row max then sum of exp (two shared-memory passes), or both in one pass with rescaling",
        ),
        Knob("LOAD_HINT", ("none", "evict_first"), "memory", "L2 policy of the bulk row loads (rows are read once)"),
        Knob("STORE", ("st", "st_cs", "bulk"), "memory", "output by vector stores, streaming stores, or a bulk copy"),
        Knob("EXP", ("expf", "exp2"), "precision", "expf, or ex2.approx of an fma with log2(e)"),
        Knob("NORMALIZE", ("div_rn", "mul_rcp"), "precision", "IEEE division, or one reciprocal per row"),
        Knob(
            "EXP_CACHE",
            ("none", "fp16"),
            "precision",
            "exp computed again in the last pass, or kept from the sum pass as fp16 in the row's slot "
            "(one exp per element instead of two; two-pass statistics only)",
        ),
    ),
    # two 64 KB buffers: the largest task row (32768 bf16) fits a stage; plain stores; ex2.approx and one
    # reciprocal per row (accurate expf and division cost 0.26 vs 0.146 ms at 4096x32768: BENCHMARKS.md runs R/S)
    start={
        "THREADS": 512,
        "STAGES": 2,
        "STAGE_KB": 64,
        "CTAS_PER_SM": 1,
        "ELEMS_PER_THREAD": 32,
        "UNROLL": 1,
        "STATS": "two_pass",
        "LOAD_HINT": "none",
        "STORE": "st",
        "EXP": "exp2",
        "NORMALIZE": "mul_rcp",
        "EXP_CACHE": "none",
    },
    render=render,
    valid=valid,
    language="cutlass",
)


FAMILIES = [CUTLASS_SOFTMAX] if offered_on_gpu(available) else []
