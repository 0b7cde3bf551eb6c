"""Softmax families (memory-bound, row reductions).

Three structurally different designs:

- ``softmax.rowblock``: whole rows in registers ([ROWS, next_pow2(N)] tile), one read and
  one write, optional persistent grid. Rows over the register budget fall back at run
  time to the online kernel rendered in the same module (any N works).
- ``softmax.online``: one program per row block, rows walked in BLOCK_N chunks: statistics
  in one streaming pass (lane-wise online max/sum, per-chunk reduced online, or the
  classic max-then-sum three-pass), then a normalising pass that re-reads the row (from
  L2 when the first pass kept it there).
- ``softmax.split_row``: two launches for long rows: several programs per row each
  reduce a span to (max, sum) in a small fp32 workspace; the second kernel combines a
  row's partials and normalises its span (optionally walking the grid backwards so the
  spans read last by the first kernel are still in L2).

All arithmetic in fp32; bf16 loads are upcast at once; the cast happens at the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families import _mem_common as mc
from kernelarc.families.base import Family, Knob

NEG_BIG = "-3.0e38"  # finite "minus infinity" for running maxima: never inf - inf

# ---------------------------------------------------------------------------------
# kernel generators


def _rows_kernel(name: str, k: Mapping[str, Any]) -> str:
    xkw = mc.load_policy_kw(k["x_load"])
    skw = mc.store_kw(k["store_cache"])
    body = f"""
rows = rb * ROWS + tl.arange(0, ROWS)
rmask = rows < M
rows = rows.to(tl.int64)
mask = rmask[:, None] & cmask[None, :]
x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf"){xkw}).to(tl.float32)
m = tl.max(x, axis=1)
m = tl.where(rmask, m, 0.0)
e = tl.exp(x - m[:, None])
s = tl.sum(e, axis=1)
y = {mc.normalize_expr(k["normalize"], "e", "s[:, None]")}
tl.store(Y + rows[:, None] * stride_y + cols[None, :], _cast_out(y, Y.dtype.element_ty), mask=mask{skw})
"""
    src = f"""


@triton.jit
def {name}(X, Y, M, N, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
"""
    return src + mc.grid_loop(bool(k["persistent"]), "tl.cdiv(M, ROWS)", "rb", body)


def _stats_loop(mode: str, load: str, lo: str, hi: str) -> str:
    """Source computing per-row ``m`` (max) and ``s`` (sum of exp(x - m)) over [lo, hi)."""
    head = f"""
for c0 in tl.range({lo}, {hi}, BLOCK_N):
    cols = c0 + tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (cols[None, :] < hi_col)
    {load}
"""
    if mode == "lanewise":
        return (
            f"""
m_vec = tl.full([ROWS, BLOCK_N], {NEG_BIG}, dtype=tl.float32)
s_vec = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)"""
            + head
            + """    m_new = tl.maximum(m_vec, x)
    s_vec = s_vec * tl.exp(m_vec - m_new) + tl.exp(x - m_new)
    m_vec = m_new
m = tl.max(m_vec, axis=1)
s = tl.sum(s_vec * tl.exp(m_vec - m[:, None]), axis=1)
"""
        )
    if mode == "chunk_reduce":
        return (
            f"""
m = tl.full([ROWS], {NEG_BIG}, dtype=tl.float32)
s = tl.zeros([ROWS], dtype=tl.float32)"""
            + head
            + """    m_new = tl.maximum(m, tl.max(x, axis=1))
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new[:, None]), axis=1)
    m = m_new
"""
        )
    if mode == "three_pass":
        return (
            f"""
m_vec = tl.full([ROWS, BLOCK_N], {NEG_BIG}, dtype=tl.float32)"""
            + head
            + """    m_vec = tl.maximum(m_vec, x)
m = tl.max(m_vec, axis=1)
s_vec = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)"""
            + head
            + """    s_vec += tl.exp(x - m[:, None])
s = tl.sum(s_vec, axis=1)
"""
        )
    raise ValueError(f"unknown online mode {mode!r}")


def _online_kernel(name: str, k: Mapping[str, Any]) -> str:
    p1 = mc.load_kw(k["pass1_evict"])
    p2 = mc.load_kw(k["pass2_evict"])
    skw = mc.store_kw(k["store_cache"])
    load1 = (
        f'x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf"){p1}).to(tl.float32)'
    )
    body = (
        """
rows = rb * ROWS + tl.arange(0, ROWS)
rmask = rows < M
rows = rows.to(tl.int64)
hi_col = N"""
        + _stats_loop(k["online_mode"], load1, "0", "N")
        + f"""
for c0 in tl.range(0, N, BLOCK_N):
    cols = c0 + tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0{p2}).to(tl.float32)
    e = tl.exp(x - m[:, None])
    y = {mc.normalize_expr(k["normalize"], "e", "s[:, None]")}
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], _cast_out(y, Y.dtype.element_ty), mask=mask{skw})
"""
    )
    src = f"""


@triton.jit
def {name}(X, Y, M, N, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
"""
    return src + mc.grid_loop(bool(k["persistent"]), "tl.cdiv(M, ROWS)", "rb", body)


def _split_kernels(k: Mapping[str, Any]) -> str:
    p1 = mc.load_kw(k["pass1_evict"])
    p2 = mc.load_kw(k["pass2_evict"])
    skw = mc.store_kw(k["store_cache"])
    load1 = (
        f'x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=-float("inf"){p1}).to(tl.float32)'
    )
    stats = _stats_loop(k["online_mode"], load1, "lo", "hi")
    pid2 = "num_programs - 1 - tl.program_id(0)" if k["norm_order"] == "reverse" else "tl.program_id(0)"
    src = f"""


@triton.jit
def _softmax_split_stats_kernel(X, WS, M, N, stride_x, SPLITS, BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr):
    ROWS: tl.constexpr = 1
    pid = tl.program_id(0)
    row = pid // SPLITS
    sp = pid % SPLITS
    rows = row + tl.arange(0, ROWS)
    rmask = rows < M
    rows = rows.to(tl.int64)
    lo = sp * (BLOCK_N * CHUNKS)
    hi = tl.minimum(lo + BLOCK_N * CHUNKS, N)
    hi_col = hi
{mc.indent(stats, 4)}
    ws = WS + rows * (2 * SPLITS) + 2 * sp
    tl.store(ws, m, mask=rmask)
    tl.store(ws + 1, s, mask=rmask)


@triton.jit
def _softmax_split_norm_kernel(X, Y, WS, M, N, stride_x, stride_y, SPLITS, num_programs,
                               BLOCK_N: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = {pid2}
    row = pid // SPLITS
    sp = pid % SPLITS
    row64 = row.to(tl.int64)
    sidx = tl.arange(0, BLOCK_S)
    smask = sidx < SPLITS
    ws = WS + row64 * (2 * SPLITS) + 2 * sidx
    ms = tl.load(ws, mask=smask, other={NEG_BIG})
    ss = tl.load(ws + 1, mask=smask, other=0.0)
    m = tl.max(ms, axis=0)
    s = tl.sum(ss * tl.exp(ms - m), axis=0)
    lo = sp * (BLOCK_N * CHUNKS)
    hi = tl.minimum(lo + BLOCK_N * CHUNKS, N)
    for c0 in tl.range(lo, hi, BLOCK_N):
        cols = c0 + tl.arange(0, BLOCK_N)
        mask = cols < hi
        x = tl.load(X + row64 * stride_x + cols, mask=mask, other=0.0{p2}).to(tl.float32)
        e = tl.exp(x - m)
        y = {mc.normalize_expr(k["normalize"], "e", "s")}
        tl.store(Y + row64 * stride_y + cols, _cast_out(y, Y.dtype.element_ty), mask=mask{skw})
"""
    return src


# ---------------------------------------------------------------------------------
# renderers

_PROLOGUE = """


def run(x):
    assert x.dim() == 2
    if x.stride(-1) != 1:
        x = x.contiguous()
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
"""


def _render_rowblock(family: str, k: Mapping[str, Any]) -> str:
    fallback = {
        "pass1_evict": "evict_last",
        "pass2_evict": mc.policy_evict(k["x_load"]),
        "store_cache": k["store_cache"],
        "normalize": k["normalize"],
        "persistent": k["persistent"],
        # chunks as large as the register budget: per-chunk reductions, no per-lane state tiles
        "online_mode": "chunk_reduce",
    }
    src = mc.header(family, "softmax: whole rows in registers (rendered candidate).", k)
    src += mc.rowblock_constants_src(k)
    src += _rows_kernel("_softmax_rows_kernel", k)
    src += _online_kernel("_softmax_online_fallback_kernel", fallback)
    src += _PROLOGUE + "    args = (x, y, M, N, x.stride(0), y.stride(0))\n"
    src += mc.rowblock_launch_src(
        "_softmax_rows_kernel", "_softmax_online_fallback_kernel", "online two-pass kernel", 2, k["persistent"]
    )
    src += "    return y\n"
    return mc.finish(src, k.get("num_stages", 1))


def _online_streams(k: Mapping[str, Any]) -> int:
    """Row tiles loaded per chunk, summed over the kernel's loops (staged when pipelined)."""
    return 3 if k["online_mode"] == "three_pass" else 2


def _split_streams(k: Mapping[str, Any]) -> int:
    """Per kernel: the statistics kernel has two loops in three_pass mode, else one."""
    return 2 if k["online_mode"] == "three_pass" else 1


def _render_online(family: str, k: Mapping[str, Any]) -> str:
    src = mc.header(family, "softmax: online statistics + normalising pass (rendered candidate).", k)
    src += f"\nNUM_WARPS = {k['num_warps']}\nNUM_STAGES = {k['num_stages']}\n"
    src += f"ROWS_PER_PROGRAM = {k['rows']}\nBLOCK_N = {k['block_n']}\n"
    src += _online_kernel("_softmax_online_kernel", k)
    p = k["persistent"]
    src += (
        _PROLOGUE
        + f"""    block_n = min(BLOCK_N, triton.next_power_of_2(N))
{mc.clamp_block_src("block_n", "ROWS_PER_PROGRAM", _online_streams(k), "x.element_size()")}\
    blocks = triton.cdiv(M, ROWS_PER_PROGRAM)
    grid = ({mc.grid_expr(p, "blocks", "x.device")},)
    _softmax_online_kernel[grid](x, y, M, N, x.stride(0), y.stride(0), BLOCK_N=block_n, ROWS=ROWS_PER_PROGRAM,
                                 num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
"""
    )
    return mc.finish(src, k.get("num_stages", 1))


def _render_split(family: str, k: Mapping[str, Any]) -> str:
    src = mc.header(family, "softmax: split rows, partial statistics + combine (rendered candidate).", k)
    src += f"\nNUM_WARPS = {k['num_warps']}\nNUM_STAGES = {k['num_stages']}\n"
    src += f"BLOCK_N = {k['block_n']}\nCHUNKS_PER_PROGRAM = {k['chunks']}\n"
    src += _split_kernels(k)
    src += (
        _PROLOGUE
        + f"""    block_n = min(BLOCK_N, triton.next_power_of_2(N))
{mc.clamp_block_src("block_n", "1", _split_streams(k), "x.element_size()")}\
    span = block_n * CHUNKS_PER_PROGRAM
    splits = triton.cdiv(N, span)
    ws = torch.empty((M, splits, 2), dtype=torch.float32, device=x.device)
    grid = (M * splits,)
    _softmax_split_stats_kernel[grid](x, ws, M, N, x.stride(0), splits, BLOCK_N=block_n, CHUNKS=CHUNKS_PER_PROGRAM,
                                      num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    _softmax_split_norm_kernel[grid](x, y, ws, M, N, x.stride(0), y.stride(0), splits, M * splits,
                                     BLOCK_N=block_n, CHUNKS=CHUNKS_PER_PROGRAM,
                                     BLOCK_S=triton.next_power_of_2(splits),
                                     num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
"""
    )
    return mc.finish(src, k.get("num_stages", 1))


# ---------------------------------------------------------------------------------
# knob spaces

_NORMALIZE = Knob(
    "normalize",
    ("div_rn", "div", "mul_rcp"),
    "precision",
    "exp / sum as IEEE division, approximate division (div.full), or one reciprocal per row and a multiply",
)
_STORE_CACHE = mc.cache_knob("store_cache", ("", ".cs"), "store cache modifier (.cs: streaming)")
_ONLINE_MODE = Knob(
    "online_mode",
    ("three_pass", "chunk_reduce", "lanewise"),
    "algorithmic",
    "statistics: max pass then sum pass; online per-chunk reduced; online per lane (reduced once at the end)",
)
_BLOCK_N = Knob(
    "block_n", (128, 256, 512, 1024, 2048, 4096, 8192, 16384), "tiling", "chunk width (clamped to next_pow2(N))"
)
_P1 = mc.evict_knob(
    "pass1_evict",
    ("", "evict_last", "evict_first"),
    "eviction of statistics-pass loads (evict_last keeps rows in L2 for the re-read)",
)
_P2 = mc.evict_knob("pass2_evict", ("", "evict_first", "evict_last"), "eviction of normalising-pass loads")


def _rowblock_valid(k: Mapping[str, Any]) -> bool:
    return bool(k["persistent"]) or k["num_stages"] == 1


def _online_valid(k: Mapping[str, Any]) -> bool:
    tile = k["block_n"] * k["rows"]
    ept = mc.elems_per_thread(tile, k["num_warps"])
    return 1 <= ept <= 128 and mc.fits_smem(k["num_stages"], tile, _online_streams(k))


def _split_valid(k: Mapping[str, Any]) -> bool:
    ept = mc.elems_per_thread(k["block_n"], k["num_warps"])
    return 1 <= ept <= 128 and mc.fits_smem(k["num_stages"], k["block_n"], _split_streams(k))


FAMILIES: list[Family] = [
    Family(
        name="softmax.rowblock",
        task="softmax",
        description="whole rows in registers, [rows, pow2(N)] tiles, optional persistent grid; "
        "online fallback for long rows",
        knobs=(
            Knob("rows", (1, 2, 4, 8, 16, 32), "tiling", "rows per program step (clamped by the register budget)"),
            Knob(
                "max_elems_per_thread",
                (16, 32, 64, 128),
                "tiling",
                "register budget (fp32 elements per thread); longer rows use the online fallback",
            ),
            mc.warps_knob(),
            mc.persistent_knob(),
            mc.stages_knob(),
            mc.load_policy_knob("x_load", "row loads"),
            _STORE_CACHE,
            _NORMALIZE,
            mc.long_rows_knob(),
        ),
        # reciprocal normalisation and 8 warps: what took 4096x32768 from 75% to 92% of a same-size copy
        # (BENCHMARKS.md run U); tl.exp is already ex2.approx of x * log2(e). Rows read once and written
        # once: evict-first loads and streaming (.cs) stores, the best points of the 2026-12-01 seeds
        # (0.139-0.142 ms against 0.141-0.148 ms for the same point with default caching, runs Q and R)
        start={
            "rows": 1,
            "max_elems_per_thread": 64,
            "num_warps": 8,
            "persistent": 0,
            "num_stages": 1,
            "x_load": "evict_first",
            "store_cache": ".cs",
            "normalize": "mul_rcp",
            "long_rows": "fallback",
        },
        render=lambda k: _render_rowblock("softmax.rowblock", k),
        valid=_rowblock_valid,
    ),
    Family(
        name="softmax.online",
        task="softmax",
        description="chunked rows: online (max, sum) statistics pass, then a normalising pass re-reading the row",
        knobs=(
            _BLOCK_N,
            Knob("rows", (1, 2, 4, 8), "tiling", "rows per program step"),
            mc.warps_knob(),
            mc.stages_knob(),
            mc.persistent_knob(),
            _ONLINE_MODE,
            _P1,
            _P2,
            _STORE_CACHE,
            _NORMALIZE,
        ),
        start={
            "block_n": 1024,
            "rows": 1,
            "num_warps": 4,
            "num_stages": 1,
            "persistent": 0,
            "online_mode": "three_pass",
            "pass1_evict": "",
            "pass2_evict": "",
            "store_cache": "",
            "normalize": "mul_rcp",
        },
        render=lambda k: _render_online("softmax.online", k),
        valid=_online_valid,
    ),
    Family(
        name="softmax.split_row",
        task="softmax",
        description="two launches: per-span partial (max, sum) into a workspace, then combine and normalise per span",
        knobs=(
            _BLOCK_N,
            Knob("chunks", (1, 2, 4, 8, 16), "tiling", "BLOCK_N chunks per program (span = block_n x chunks)"),
            mc.warps_knob(),
            mc.stages_knob(),
            _ONLINE_MODE,
            _P1,
            _P2,
            Knob(
                "norm_order",
                ("forward", "reverse"),
                "memory",
                "normalising kernel walks the grid forwards, or backwards to re-read the last spans from L2",
            ),
            _STORE_CACHE,
            _NORMALIZE,
        ),
        start={
            "block_n": 1024,
            "chunks": 1,
            "num_warps": 4,
            "num_stages": 1,
            "online_mode": "chunk_reduce",
            "pass1_evict": "",
            "pass2_evict": "",
            "norm_order": "forward",
            "store_cache": "",
            "normalize": "mul_rcp",
        },
        render=lambda k: _render_split("softmax.split_row", k),
        valid=_split_valid,
    ),
]
