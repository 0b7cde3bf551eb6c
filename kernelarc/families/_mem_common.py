"""Shared pieces of the memory-bound families (norms, rowwise, elementwise).

Private module (leading underscore): discovery skips it. It holds the candidate
header, small source-snippet helpers and the knob constructors the families share,
so every family spells warps, stages, eviction and persistent grids the same way.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping
from string import Template
from typing import Any

from kernelarc.families.base import Knob

# ``_cast_out(x, DT)`` in candidate source (INTERPRET defined before it): a value to an output dtype; under
# Triton's interpreter, which truncates fp32 -> bf16, rounded to nearest even as the GPU does. Shared by
# the memory-bound families' header and the recurrence kernels (kernelarc.graph.recurrence).
CAST_OUT = """
if INTERPRET:

    @triton.jit
    def _cast_out(x, DT: tl.constexpr):
        # Triton's interpreter truncates fp32 -> bf16; round to nearest even as the GPU does.
        if DT == tl.bfloat16:
            b = x.to(tl.float32).to(tl.uint32, bitcast=True)
            b = (b + (((b >> 16) & 1) + 0x7FFF)) & 0xFFFF0000
            return b.to(tl.float32, bitcast=True).to(DT)
        else:
            return x.to(DT)

else:

    @triton.jit
    def _cast_out(x, DT: tl.constexpr):
        return x.to(DT)
"""

# The header of every rendered candidate. INTERPRET is decided at import; the SM count
# is read at call time and only for CUDA tensors (never at import, never on the CPU).
HEADER = (
    '''"""$doc

Rendered by kernelarc family $family with knobs:
$knob_lines
"""

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _num_sms(device):
    if device.type == "cuda" and not INTERPRET:
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4

'''
    + CAST_OUT
)

# ---------------------------------------------------------------------------------
# source helpers


def indent(src: str, spaces: int) -> str:
    return textwrap.indent(textwrap.dedent(src).strip("\n"), " " * spaces) + "\n"


def header(family: str, doc: str, knobs: Mapping[str, Any]) -> str:
    lines = "\n".join(f"    {k} = {v!r}" for k, v in knobs.items())
    return Template(HEADER).substitute(doc=doc, family=family, knob_lines=lines)


def finish(src: str, stages: int = 1) -> str:
    """Final touches on a rendered module.

    ``stages`` > 1 annotates every ``tl.range`` loop with ``num_stages``: Triton 3.6
    software-pipelines loads that feed no dot (through cp.async and shared memory) only
    for loops annotated that way; the kernel-level ``num_stages`` alone leaves them be.
    Blank lines are normalised (at most two in a row, one final newline).
    """
    if stages > 1:
        src = re.sub(r"tl\.range\(([^\n]*)\):\n", rf"tl.range(\1, num_stages={stages}):\n", src)
    src = re.sub(r"\n[ \t]+\n", "\n\n", src)
    return re.sub(r"\n{4,}", "\n\n\n", src).rstrip("\n") + "\n"


def load_kw(evict: str = "", cache: str = "") -> str:
    """Extra keyword arguments of a ``tl.load`` (eviction policy, cache modifier)."""
    out = ""
    if cache:
        out += f', cache_modifier="{cache}"'
    if evict:
        out += f', eviction_policy="{evict}"'
    return out


LOAD_POLICIES = ("default", "evict_first", "evict_last", "cg")


def load_policy_kw(policy: str) -> str:
    """tl.load keywords for one streaming-load policy.

    One knob rather than eviction x cache modifier: ptxas rejects ``.cg`` combined with
    an L1 eviction priority, so the combinations that assemble are listed here.
    """
    if policy == "default":
        return ""
    if policy in ("evict_first", "evict_last"):
        return load_kw(evict=policy)
    if policy == "cg":
        return load_kw(cache=".cg")
    raise ValueError(f"unknown load policy {policy!r}")


def policy_evict(policy: str) -> str:
    """The eviction part of a load policy (for loads that take only an eviction policy)."""
    return policy if policy in ("evict_first", "evict_last") else ""


def load_policy_knob(name: str, doc: str) -> Knob:
    return Knob(name, LOAD_POLICIES, "memory", doc + " (default, evict_first, evict_last, or .cg: L2 only)")


def store_kw(cache: str = "") -> str:
    return f', cache_modifier="{cache}"' if cache else ""


def rsqrt_expr(mode: str, arg: str) -> str:
    """Reciprocal square root: IEEE sqrt and a true division, or the fast MUFU rsqrt."""
    if mode == "sqrt_div":
        return f"tl.math.div_rn(1.0, tl.sqrt_rn({arg}))"
    if mode == "rsqrt":
        return f"tl.math.rsqrt({arg})"
    raise ValueError(f"unknown rsqrt mode {mode!r}")


def normalize_expr(mode: str, num: str, den: str) -> str:
    """num / den with IEEE division, the fast approximate division, or a reciprocal multiply."""
    if mode == "div_rn":
        return f"tl.math.div_rn({num}, {den})"
    if mode == "div":
        return f"{num} / {den}"
    if mode == "mul_rcp":
        return f"{num} * (1.0 / {den})"
    raise ValueError(f"unknown normalize mode {mode!r}")


def grid_loop(persistent: bool, count: str, var: str, body: str, base_indent: int = 4) -> str:
    """A program's work: one block (``var = program_id``) or a grid-stride loop over blocks."""
    pad = " " * base_indent
    if persistent:
        return f"{pad}for {var} in tl.range(tl.program_id(0), {count}, tl.num_programs(0)):\n" + indent(
            body, base_indent + 4
        )
    return f"{pad}{var} = tl.program_id(0)\n" + indent(body, base_indent)


def grid_expr(persistent: int, blocks: str, device: str) -> str:
    """Launcher expression for the 1-D grid size."""
    if persistent:
        return f"max(1, min({blocks}, _num_sms({device}) * {persistent}))"
    return f"max(1, {blocks})"


# ---------------------------------------------------------------------------------
# shared memory of pipelined loops
#
# With num_stages > 1 Triton stages each pipelined load of a loop in shared memory,
# (num_stages - 1) buffers of the loaded tile per load (measured on sm_90a PTX). Past
# ~227 KB per program the launch fails, so tiles are kept under a budget: valid()
# prunes points that cannot fit for bf16 inputs, and launchers clamp at run time for
# any dtype and shape.

SMEM_BUDGET = 160 * 1024


def staged_bytes(stages: int, tile_elems: int, streams: int, elem_bytes: int = 2) -> int:
    """Shared memory staged by pipelined loops: ``streams`` = loaded tiles summed over loops."""
    return max(0, stages - 1) * tile_elems * streams * elem_bytes


def fits_smem(stages: int, tile_elems: int, streams: int, elem_bytes: int = 2) -> bool:
    return staged_bytes(stages, tile_elems, streams, elem_bytes) <= SMEM_BUDGET


def clamp_block_src(var: str, rows: str, streams: int, esize: str, indent_: int = 4) -> str:
    """Launcher lines halving ``var`` until the staged tiles fit the shared-memory budget."""
    pad = " " * indent_
    return (
        f"{pad}while NUM_STAGES > 1 and {var} > 16 and "
        f"(NUM_STAGES - 1) * {rows} * {var} * {streams} * {esize} > {SMEM_BUDGET}:\n"
        f"{pad}    {var} //= 2\n"
    )


# ---------------------------------------------------------------------------------
# knob constructors shared by the families

WARPS = (1, 2, 4, 8, 16, 32)
STAGES = (1, 2, 3, 4)
PERSISTENT = (0, 1, 2, 4, 8, 16)


def warps_knob(name: str = "num_warps") -> Knob:
    return Knob(name, WARPS, "scheduling", "warps per program (threads = 32 x warps)")


def stages_knob() -> Knob:
    return Knob(
        "num_stages",
        STAGES,
        "scheduling",
        "software-pipelining depth of the kernel's loops (only meaningful with a loop)",
    )


def persistent_knob() -> Knob:
    return Knob(
        "persistent",
        PERSISTENT,
        "scheduling",
        "0: one program per block of work; k>0: a grid of k x SMs programs striding over blocks",
    )


def evict_knob(name: str, values: tuple[str, ...], doc: str) -> Knob:
    return Knob(name, values, "memory", doc)


def cache_knob(name: str, values: tuple[str, ...], doc: str) -> Knob:
    return Knob(name, values, "memory", doc)


def long_rows_knob() -> Knob:
    return Knob(
        "long_rows",
        ("fallback", "more_warps"),
        "scheduling",
        "a row over the per-thread register budget: take the chunked fallback kernel, or keep the whole-row "
        "kernel and double the warps (up to 16) until the row fits",
    )


def rowblock_constants_src(k: Mapping[str, Any]) -> str:
    """Module constants of a whole-row (``*.rowblock``) candidate, read by :func:`rowblock_launch_src`."""
    return (
        f"\nNUM_WARPS = {k['num_warps']}\nNUM_STAGES = {k['num_stages']}\n"
        f"ROWS_PER_PROGRAM = {k['rows']}\nMAX_ELEMS_PER_THREAD = {k['max_elems_per_thread']}\n"
        f"LONG_ROWS = {k['long_rows']!r}\n"
    )


def rowblock_launch_src(
    rows_kernel: str, fallback_kernel: str, fallback_doc: str, streams: int, persistent: int
) -> str:
    """Launcher lines of a whole-row candidate (needs ``args``, ``x``, ``M``, ``N`` and the constants above).

    ``cap`` is the row budget at NUM_WARPS; ``warps`` / ``wide`` are the warps and row budget of the
    whole-row kernel (doubled for long rows when LONG_ROWS is "more_warps"). Rows within ``wide`` run
    ``rows_kernel``; longer rows run ``fallback_kernel`` in ``cap``-wide chunks at NUM_WARPS.
    """
    esize = "x.element_size()"
    grid = grid_expr(persistent, "blocks", "x.device")
    return (
        "    cap = MAX_ELEMS_PER_THREAD * 32 * NUM_WARPS\n"
        + clamp_block_src("cap", "1", streams, esize)
        + "    block_n = triton.next_power_of_2(N)\n"
        "    warps, wide = NUM_WARPS, cap\n"
        '    while LONG_ROWS == "more_warps" and block_n > wide and warps < 16:\n'
        "        warps *= 2\n"
        "        wide = MAX_ELEMS_PER_THREAD * 32 * warps\n"
        + clamp_block_src("wide", "1", streams, esize, 8)
        + f"""    if block_n <= wide:
        rows = max(1, min(ROWS_PER_PROGRAM, wide // block_n))
        blocks = triton.cdiv(M, rows)
        grid = ({grid},)
        {rows_kernel}[grid](*args, BLOCK_N=block_n, ROWS=rows, num_warps=warps, num_stages=NUM_STAGES)
    else:
        # Row over the register (or staged shared-memory) budget: {fallback_doc}.
        blocks = M
        grid = ({grid},)
        {fallback_kernel}[grid](*args, BLOCK_N=cap, ROWS=1, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
"""
    )


def elems_per_thread(block_elems: int, num_warps: int) -> float:
    return block_elems / (32 * num_warps)
