"""Parameterized kernel families: the offline search agents' move space.

A family renders a complete, self-contained candidate source file (a Python module
defining ``run(*inputs)``) from a dict of knob values. Knob values are baked into
the source as constants, so every rendered candidate is an ordinary candidate that
the guard can check, time, register and export like any other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

STRATEGIES = ("tiling", "memory", "precision", "fusion", "scheduling", "algorithmic")

# Hopper (sm_90, H100/H200) shared memory: what one block may opt in to, and what an SM holds in all
SM90_SMEM_PER_BLOCK = 227 * 1024
SM90_SMEM_PER_SM = 228 * 1024


def ptxas_usage(ptx: str) -> tuple[int | None, int | None]:
    """Registers per thread and bytes spilled of ``ptx`` assembled for sm_90a by the ``ptxas`` bundled with Triton
    (``-v``), without a GPU (None where ptxas is missing or does not say)."""
    import os
    import re
    import subprocess
    import tempfile

    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    try:
        with tempfile.TemporaryDirectory() as d:
            src, out = os.path.join(d, "k.ptx"), os.path.join(d, "k.cubin")
            with open(src, "w") as f:
                f.write(ptx)
            err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", src, "-o", out], capture_output=True,
                                 text=True).stderr  # fmt: skip
    except OSError:
        return None, None
    regs, spill = re.search(r"Used (\d+) registers", err), re.search(r"(\d+) bytes spill stores", err)
    return (int(regs.group(1)) if regs else None), (int(spill.group(1)) if spill else None)


@dataclass(frozen=True)
class Knob:
    """One tunable parameter of a family.

    ``values`` is ordered so that neighbouring values are neighbouring designs: the
    search takes local steps by moving one index up or down.
    """

    name: str
    values: tuple[Any, ...]
    strategy: str  # the strategy (one of STRATEGIES) that owns moves of this knob
    doc: str = ""

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"knob {self.name}: unknown strategy {self.strategy!r}")
        if not self.values:
            raise ValueError(f"knob {self.name}: empty value list")


def _always_valid(knobs: Mapping[str, Any]) -> bool:
    return True


@dataclass(frozen=True)
class Family:
    """A parameterized kernel design for one built-in task."""

    name: str  # globally unique, e.g. "matmul.tma_persistent"
    task: str  # built-in task name the rendered source solves
    description: str  # one line, shown to users and on the board
    knobs: tuple[Knob, ...]
    start: Mapping[str, Any]  # conservative, valid starting point (never a hand-pinned best)
    render: Callable[[Mapping[str, Any]], str]  # knobs -> full candidate source
    valid: Callable[[Mapping[str, Any]], bool] = field(default=_always_valid)
    language: str = "triton"
    # operand dtypes the kernel takes (None: whatever its task gives); a composed problem's site of another
    # dtype is not offered the family (kernelarc.families.composed)
    dtypes: tuple[str, ...] | None = None

    def knob(self, name: str) -> Knob:
        for k in self.knobs:
            if k.name == name:
                return k
        raise KeyError(f"{self.name} has no knob {name!r}")

    def check_point(self, knobs: Mapping[str, Any]) -> dict[str, Any]:
        """Return a complete knob dict (defaults from ``start``), validated."""
        point = dict(self.start)
        point.update(knobs)
        for k in self.knobs:
            if point.get(k.name) not in k.values:
                raise ValueError(f"{self.name}: {k.name}={point.get(k.name)!r} not in {k.values}")
        unknown = set(point) - {k.name for k in self.knobs}
        if unknown:
            raise ValueError(f"{self.name}: unknown knobs {sorted(unknown)}")
        return point


def offered_on_gpu(available: Callable[[], bool]) -> bool:
    """Whether a family that needs a CUDA GPU and a toolchain (``available``) is offered to the
    search here: only where its kernels can be built and run."""
    try:
        import torch

        return bool(torch.cuda.is_available()) and available()
    except Exception:  # noqa: BLE001 - a broken toolkit means: not offered
        return False


def cutlass_candidate_head(family: str, knobs: Mapping[str, Any], cpp: str) -> str:
    """The opening every CUTLASS candidate shares: a docstring naming the family and its knobs, the
    C++ as ``CPP``, and ``_KERNEL`` built from it at import by the trusted helper kernelarc.cutlass."""
    knob_lines = "\n".join(f"    {name} = {knobs[name]!r}" for name in sorted(knobs))
    return f'''"""KernelArc candidate rendered by kernel family {family} (language cutlass).

Knobs:
{knob_lines}
"""

import torch

from kernelarc import cutlass as _cutlass

CPP = r"""
{cpp}"""

_KERNEL = _cutlass.load(CPP)
'''
