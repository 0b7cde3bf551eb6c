"""A counting-sort kernel family: the stable sort of small non-negative integer keys, and their histogram.

MoE routing sorts token-expert assignments by expert and counts them per expert: ``torch.sort(ids, stable=True)``
for the permutation that groups tokens by expert, ``torch.bincount(ids, minlength=E)`` (and its ``cumsum``) for
each expert's segment (SOL-ExecBench L1/058). Eager PyTorch runs a 32-bit radix sort (a pass per key byte) for keys
that hold 8 bits, and ``bincount`` reads ``ids.min()`` and ``ids.max()`` on the host before it counts: two device
syncs per call, which also keep the whole step out of a CUDA graph. Inductor has no kernel for either.

``counting_sort.blocked`` knows the keys lie in [0, E) (recognition proves it from the graph,
``kernelarc.graph.sorting``) and sorts them in two launches, no host sync:

1. one program per block of ``BLOCK`` keys counts its keys per bin (``tl.histogram``);
2. one program per block sums the counts of every block (the totals, their running sum: the histogram and its
   ``cumsum`` where asked for) and of the blocks before its own, which gives each bin's first output slot for this
   block; it sorts its block in registers on (key, position) pairs (``tl.sort``: unique pairs, so the order
   between equal keys is the input order) and writes each position to its slot: the permutation of a stable sort,
   and the sorted keys where asked for.

Task (``counting_sort``, served through composed problems' sort sites): ``run(keys, bins, sort, values, counts,
offsets)`` with ``keys`` 1-D int32 / int64 in [0, ``bins``); returns (permutation int64, sorted keys, histogram
int64, its running sum int64), each None where not asked for; None as a whole for inputs it does not take (the
caller runs the graph's own ops). Keys outside [0, bins) are neither counted nor placed (the reference raises for
them: its histogram would not have ``bins`` entries).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families.base import Family, Knob
from kernelarc.families.matmul import _header

_KERNEL = """

@triton.jit
def _block_counts(keys_ptr, cnt_ptr, N, E, BLOCK: tl.constexpr, BINS: tl.constexpr):
    b = tl.program_id(0)
    i = b * BLOCK + tl.arange(0, BLOCK)
    k = tl.load(keys_ptr + i, mask=i < N, other=-1)
    ok = (k >= 0) & (k < E)
    h = tl.histogram(tl.where(ok, k, 0).to(tl.int32), BINS)
    bins = tl.arange(0, BINS)
    # keys outside [0, E) and the lanes past N were counted in bin 0: taken out again
    h = h - tl.where(bins == 0, tl.sum((~ok).to(tl.int32), 0), 0)
    tl.store(cnt_ptr + b * BINS + bins, h)


@triton.jit
def _place(keys_ptr, cnt_ptr, adj_ptr, perm_ptr, vals_ptr, counts_ptr, offs_ptr, N, NB, E,
           BLOCK: tl.constexpr, BINS: tl.constexpr, RB: tl.constexpr, SORT: tl.constexpr,
           VALUES: tl.constexpr, COUNTS: tl.constexpr, OFFSETS: tl.constexpr):
    b = tl.program_id(0)
    bins = tl.arange(0, BINS)
    total = tl.zeros([BINS], dtype=tl.int32)
    before = tl.zeros([BINS], dtype=tl.int32)
    for r0 in range(0, NB, RB):
        rows = r0 + tl.arange(0, RB)
        c = tl.load(cnt_ptr + rows[:, None] * BINS + bins[None, :], mask=(rows < NB)[:, None], other=0)
        total += tl.sum(c, 0)
        before += tl.sum(tl.where((rows < b)[:, None], c, 0), 0)
    incl = tl.cumsum(total, 0)
    if b == 0:
        if COUNTS:
            tl.store(counts_ptr + bins, total.to(tl.int64), mask=bins < E)
        if OFFSETS:
            tl.store(offs_ptr + bins, incl.to(tl.int64), mask=bins < E)
    if SORT:
        mine = tl.load(cnt_ptr + b * BINS + bins)
        # a key's slot = (keys of lower bins) + (its bin's keys in earlier blocks) + (its rank in its bin here);
        # its position j in the sorted block is (this block's keys of lower bins) + that rank
        adj = (incl - total) + before - (tl.cumsum(mine, 0) - mine)
        tl.store(adj_ptr + b * BINS + bins, adj)
        tl.debug_barrier()
        j = tl.arange(0, BLOCK)
        i = b * BLOCK + j
        k = tl.load(keys_ptr + i, mask=i < N, other=-1)
        ok = (k >= 0) & (k < E)
        s = tl.sort(tl.where(ok, k, E).to(tl.int32) * BLOCK + j)  # (key, position): unique, so stable
        sk = s // BLOCK
        placed = sk < E
        pos = tl.load(adj_ptr + b * BINS + sk, mask=placed, other=0) + j
        tl.store(perm_ptr + pos, (b * BLOCK + s % BLOCK).to(tl.int64), mask=placed)
        if VALUES:
            tl.store(vals_ptr + pos, sk.to(vals_ptr.dtype.element_ty), mask=placed)
"""

_LAUNCHER = '''

MAX_BLOCKS = 256  # blocks read every block's counts: past this many keys per block grow instead
MAX_BLOCK = 8192  # keys sorted in registers per program


def run(keys, bins, sort=True, values=False, counts=False, offsets=False):
    """(permutation, sorted keys, histogram, its running sum) of ``keys`` in [0, ``bins``), each None where not
    asked for; None for inputs this kernel does not take."""
    if keys.dim() != 1 or keys.dtype not in (torch.int32, torch.int64) or not keys.is_contiguous():
        return None
    n = keys.shape[0]
    blk = max(BLOCK, min(MAX_BLOCK, triton.next_power_of_2(triton.cdiv(max(n, 1), MAX_BLOCKS))))
    if not 1 <= bins <= MAX_BINS or n >= 2**31 - blk or (bins + 1) * blk >= 2**31:
        return None
    dev = keys.device
    perm = torch.empty(n, dtype=torch.int64, device=dev) if sort else None
    vals = torch.empty(n, dtype=keys.dtype, device=dev) if sort and values else None
    if n == 0:
        zeros = torch.zeros(bins, dtype=torch.int64, device=dev)
        return perm, vals, zeros if counts else None, zeros.clone() if offsets else None
    # every bin is written by the second launch's first program: no fill launched for them
    hist = torch.empty(bins, dtype=torch.int64, device=dev) if counts else None
    offs = torch.empty(bins, dtype=torch.int64, device=dev) if offsets else None
    nbins = triton.next_power_of_2(bins)
    nb = triton.cdiv(n, blk)
    if nb * nbins >= 2**31:  # the counts' int32 offsets
        return None
    cnt = torch.empty((nb, nbins), dtype=torch.int32, device=dev)
    adj = torch.empty((nb, nbins), dtype=torch.int32, device=dev) if sort else cnt
    _block_counts[(nb,)](keys, cnt, n, bins, BLOCK=blk, BINS=nbins, num_warps=NUM_WARPS)
    rb = max(1, min(triton.next_power_of_2(nb), max(1, 4096 // nbins)))
    dummy = cnt
    _place[(nb if sort else 1,)](
        keys, cnt, adj, perm if sort else dummy, vals if vals is not None else dummy,
        hist if counts else dummy, offs if offsets else dummy, n, nb, bins,
        BLOCK=blk, BINS=nbins, RB=rb, SORT=bool(sort), VALUES=vals is not None, COUNTS=bool(counts),
        OFFSETS=bool(offsets), num_warps=NUM_WARPS,
    )
    return perm, vals, hist, offs
'''


def render(k: Mapping[str, Any]) -> str:
    from kernelarc.graph.sorting import MAX_BINS

    # bins held per program: its histogram in shared memory, a few vectors of bins in registers
    consts = f"BLOCK = {k['BLOCK']!r}\nNUM_WARPS = {k['num_warps']!r}\nMAX_BINS = {MAX_BINS}\n"
    return _header(FAMILY_NAME, k) + "\n" + consts + _KERNEL + _LAUNCHER


FAMILY_NAME = "counting_sort.blocked"

BLOCKED = Family(
    name=FAMILY_NAME,
    task="counting_sort",
    description="stable sort of keys in [0, E) and their histogram: per-block counts, then one program per block "
    "places its block (sorted in registers on key and position) at each bin's slot; two launches, no host sync",
    knobs=(
        Knob("BLOCK", (1024, 2048, 512, 4096, 256), "tiling", "keys per program (more where blocks would pass 256)"),
        Knob("num_warps", (4, 8, 2), "scheduling", "warps per program"),
    ),
    start={"BLOCK": 1024, "num_warps": 4},
    render=render,
)

FAMILIES = [BLOCKED]
