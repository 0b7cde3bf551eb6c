"""Shared pieces of the memory-bound families (norms, rowwise, elementwise).

Private module (leading underscore): discovery skips it. It holds the candidate
header, small source-snippet helpers and the knob constructors the families share,
so every family spells warps, stages, eviction and persistent grids the same way.
"""

from __future__ import annotations

import textwrap
from collections.abc import Mapping
from string import Template
from typing import Any

from kernelarc.families.base import Knob

# The header of every rendered candidate. INTERPRET is decided at import; the SM count
# is read at call time and only for CUDA tensors (never at import, never on the CPU).
HEADER = '''"""$doc

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

LOG2E = 1.4426950408889634

# ---------------------------------------------------------------------------------
# source helpers


def fill(template: str, **subs: Any) -> str:
    """Dedent ``template`` and substitute ``$name`` placeholders (all must be given)."""
    return Template(textwrap.dedent(template)).substitute(**{k: str(v) for k, v in subs.items()})


def indent(src: str, spaces: int) -> str:
    return textwrap.indent(textwrap.dedent(src).strip("\n"), " " * spaces) + "\n"


def header(family: str, doc: str, knobs: Mapping[str, Any]) -> str:
    lines = "\n".join(f"    {k} = {v!r}" for k, v in knobs.items())
    return Template(HEADER).substitute(doc=doc, family=family, knob_lines=lines)


def load_kw(evict: str = "", cache: str = "") -> str:
    """Extra keyword arguments of a ``tl.load`` (eviction policy, cache modifier)."""
    out = ""
    if cache:
        out += f', cache_modifier="{cache}"'
    if evict:
        out += f', eviction_policy="{evict}"'
    return out


def store_kw(cache: str = "") -> str:
    return f', cache_modifier="{cache}"' if cache else ""


def rsqrt_expr(mode: str, arg: str) -> str:
    """Reciprocal square root: IEEE sqrt and a true division, or the fast MUFU rsqrt."""
    if mode == "sqrt_div":
        return f"1.0 / tl.sqrt_rn({arg})"
    if mode == "rsqrt":
        return f"tl.math.rsqrt({arg})"
    raise ValueError(f"unknown rsqrt mode {mode!r}")


def grid_loop(persistent: bool, count: str, var: str, body: str, base_indent: int = 4) -> str:
    """A program's work: one block (``var = program_id``) or a grid-stride loop over blocks."""
    pad = " " * base_indent
    if persistent:
        return (
            f"{pad}for {var} in tl.range(tl.program_id(0), {count}, tl.num_programs(0)):\n"
            + indent(body, base_indent + 4)
        )
    return f"{pad}{var} = tl.program_id(0)\n" + indent(body, base_indent)


def grid_expr(persistent: int, blocks: str, device: str) -> str:
    """Launcher expression for the 1-D grid size."""
    if persistent:
        return f"max(1, min({blocks}, _num_sms({device}) * {persistent}))"
    return f"max(1, {blocks})"


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


def elems_per_thread(block_elems: int, num_warps: int) -> float:
    return block_elems / (32 * num_warps)
