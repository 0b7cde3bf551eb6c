"""A scatter-add kernel family: ``out = base.index_add(0, index, source)`` as one pass over the output rows.

SOL-ExecBench's MoE combine steps and embedding backward passes end in ``index_add_``: a clone of the
hidden states (or a zero buffer the size of a vocabulary) into which every selected row of ``source`` is added
at its token's row, often followed by a cast (an fp32 gradient buffer written out in bf16). Eager PyTorch and
Inductor both write the base first (a copy, or a zero fill), then add every source row atomically, then cast in
a third pass: L1/087's 65536 x 4096 fp32 buffer is written, read back atomically and read again for the bf16
cast, where its rows mostly receive nothing.

``scatter_add.sorted`` sorts the indices once (``torch.sort``, stable) and finds each output row's range in
them (``torch.searchsorted``: no host sync); then one program per (output row, column block) starts from the base
row (or zero), adds the source rows that land there in fp32 in index order, and stores the sum once in the
output dtype. Every output row is written exactly once, no atomics, and the cast is the store: the base and the
output are each touched once, the source rows once each. Sums run in fp32 and are rounded once (eager bf16
``index_add_`` rounds after every atomic add: the difference is within a problem's bf16 tolerance).

Task (``scatter_add``, served through composed problems' scatter sites): ``run(base, index, source, rows,
out_dtype)`` with ``base`` [rows, ...] or None (a zero base), ``index`` [n] integer, ``source`` [n, ...] of the
base's trailing shape; returns the [rows, ...] sum in ``out_dtype``. Indices outside [0, rows) are dropped (eager
raises a device-side assert for them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families.base import Family, Knob
from kernelarc.families.matmul import _header

_KERNEL = """

@triton.jit
def _scatter_rows(base_ptr, src_ptr, perm_ptr, offs_ptr, out_ptr, H, s_base, s_src,
                  HAS_BASE: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    if HAS_BASE:
        acc = tl.load(base_ptr + r * s_base + cols, mask=mask, other=0.0).to(tl.float32)
    else:
        acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    start = tl.load(offs_ptr + r)
    end = tl.load(offs_ptr + r + 1)
    for j in range(start, end):
        p = tl.load(perm_ptr + j).to(tl.int64)
        acc += tl.load(src_ptr + p * s_src + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * H + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)
"""

_LAUNCHER = '''

def run(base, index, source, rows, out_dtype):
    """base.index_add(0, index, source) (a zero base where ``base`` is None) as ``out_dtype``: one pass per row."""
    idx = index.reshape(-1)
    n = idx.shape[0]
    if source.shape[0] != n:
        raise ValueError(f"scatter_add: {n} indices for {source.shape[0]} source rows")
    trailing = tuple(source.shape[1:])
    if base is not None and (base.shape[0] != rows or tuple(base.shape[1:]) != trailing):
        raise ValueError(f"scatter_add: base {tuple(base.shape)} does not take source rows {trailing}")
    H = 1
    for d in trailing:
        H *= d
    out = torch.empty((rows, *trailing), device=source.device, dtype=out_dtype)
    if rows == 0 or H == 0:
        return out
    src = source.reshape(n, H)
    if src.stride(-1) != 1:
        src = src.contiguous()
    b2 = None
    if base is not None:
        b2 = base.reshape(rows, H)
        if b2.stride(-1) != 1:
            b2 = b2.contiguous()
    if n:
        vals, perm = torch.sort(idx, stable=True)
        # row r's source rows sit at offs[r]:offs[r + 1] of the sorted order (no host sync; indices below 0 or
        # from ``rows`` on fall outside every row's range)
        offs = torch.searchsorted(vals, torch.arange(rows + 1, device=idx.device, dtype=vals.dtype))
    else:
        perm = torch.zeros(1, device=source.device, dtype=torch.int64)
        offs = torch.zeros(rows + 1, device=source.device, dtype=torch.int64)
    grid = (rows, triton.cdiv(H, BLOCK_H))
    _scatter_rows[grid](
        b2 if b2 is not None else src, src, perm, offs, out, H,
        b2.stride(0) if b2 is not None else 0, src.stride(0),
        HAS_BASE=b2 is not None, BLOCK_H=BLOCK_H, num_warps=NUM_WARPS,
    )
    return out
'''


def render(k: Mapping[str, Any]) -> str:
    consts = f"BLOCK_H = {k['BLOCK_H']!r}\nNUM_WARPS = {k['num_warps']!r}\n"
    return _header(FAMILY_NAME, k) + "\n" + consts + _KERNEL + _LAUNCHER


def _valid(k: Mapping[str, Any]) -> bool:
    return k["BLOCK_H"] >= 32 * k["num_warps"]  # every thread holds at least one column


FAMILY_NAME = "scatter_add.sorted"

SORTED = Family(
    name=FAMILY_NAME,
    task="scatter_add",
    description="index_add over rows: indices sorted once, one program per output row and column block sums its "
    "source rows in fp32 from the base row and stores once in the output dtype (no atomics, cast fused)",
    knobs=(
        Knob("BLOCK_H", (1024, 256, 512, 2048, 4096), "tiling", "columns of an output row per program"),
        Knob("num_warps", (4, 2, 8), "scheduling", "warps per program"),
    ),
    start={"BLOCK_H": 1024, "num_warps": 4},
    render=render,
    valid=_valid,
)

FAMILIES = [SORTED]
