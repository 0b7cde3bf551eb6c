"""RMSNorm and fused residual-add + RMSNorm families (memory-bound, row reductions).

Two structurally different designs per task:

- ``*.rowblock``: a [ROWS, next_pow2(N)] tile per step, whole rows held in registers,
  one read and one write of every element; optional persistent grid-stride loop. Rows
  too long for the register budget (``max_elems_per_thread``) fall back at run time to
  the chunked kernel rendered into the same module, so any N is handled.
- ``*.chunked``: rows walked in BLOCK_N chunks twice (sum of squares, then normalise and
  store), the second pass re-reading the row (from L2 when the first pass kept it there).
  For fused_add_rmsnorm the second pass re-reads either both inputs or the residual just
  written (half the bytes, norm of the bf16-rounded sum: a fusion/precision trade).

All arithmetic is fp32 (bf16 loads are upcast immediately, which also keeps Triton's
interpreter right); the cast happens at the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families import _mem_common as mc
from kernelarc.families.base import Family, Knob

EPS = "1e-06"

# ---------------------------------------------------------------------------------
# kernel generators (shared by rmsnorm and fused_add_rmsnorm)


def _kernel_args(fused: bool) -> str:
    if fused:  # STORE_RO: a composed problem that never reads the sum back skips its store (a third of the traffic)
        return "X, R, W, Y, RO, M, N, stride_x, stride_r, stride_y, stride_ro, STORE_RO: tl.constexpr"
    return "X, W, Y, M, N, stride_x, stride_y"


def _rows_kernel(name: str, fused: bool, k: Mapping[str, Any]) -> str:
    """Whole rows in registers: [ROWS, BLOCK_N] tile, BLOCK_N >= N."""
    xkw = mc.load_policy_kw(k["x_load"])
    skw = mc.store_kw(k["store_cache"])
    add = ""
    early = ""
    late = ""
    if fused:
        add = f"""
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0{xkw}).to(tl.float32)
        x = x + r
        """
        store_res = (
            "if STORE_RO: tl.store(RO + rows[:, None] * stride_ro + cols[None, :], "
            f"_cast_out(x, RO.dtype.element_ty), mask=mask{skw})"
        )
        if k["residual_store"] == "early":
            early = store_res
        else:
            late = store_res
    body = f"""
    rows = rb * ROWS + tl.arange(0, ROWS)
    rmask = rows < M
    rows = rows.to(tl.int64)
    mask = rmask[:, None] & cmask[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0{xkw}).to(tl.float32)
    {mc.indent(add, 4).strip()}
    {early}
    ss = tl.sum(x * x, axis=1)
    rstd = {mc.rsqrt_expr(k["rsqrt"], "ss / N + " + EPS)}
    y = (x * rstd[:, None]) * w[None, :]
    {late}
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], _cast_out(y, Y.dtype.element_ty), mask=mask{skw})
    """
    body = "\n".join(line for line in body.splitlines() if line.strip())
    src = f"""


@triton.jit
def {name}({_kernel_args(fused)}, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    cols = tl.arange(0, BLOCK_N)
    cmask = cols < N
    w = tl.load(W + cols, mask=cmask, other=0.0{mc.load_kw(k["w_evict"])}).to(tl.float32)
"""
    return src + mc.grid_loop(bool(k["persistent"]), "tl.cdiv(M, ROWS)", "rb", body)


def _chunked_kernel(name: str, fused: bool, k: Mapping[str, Any]) -> str:
    """Two passes over BLOCK_N chunks: sum of squares, then normalise + store."""
    p1 = mc.load_kw(k["pass1_evict"])
    p2 = mc.load_kw(k["pass2_evict"])
    skw = mc.store_kw(k["store_cache"])
    second = k.get("second_pass", "inputs")
    pass1_add = ""
    if fused:
        gate = "" if second == "residual_out" else "if STORE_RO: "  # that second pass re-reads the stored sum
        pass1_add = f"""
            r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0{p1}).to(tl.float32)
            x = x + r
            {gate}tl.store(RO + rows[:, None] * stride_ro + cols[None, :], _cast_out(x, RO.dtype.element_ty), \
mask=mask{skw})
        """
    if fused and second == "residual_out":
        barrier = "tl.debug_barrier()  # residual_out written by other threads of this program"
        reload = f"x = tl.load(RO + rows[:, None] * stride_ro + cols[None, :], mask=mask, other=0.0{p2}).to(tl.float32)"
    else:
        barrier = ""
        reload = f"x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0{p2}).to(tl.float32)"
        if fused:
            reload += (
                "\nx = x + tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, "
                f"other=0.0{p2}).to(tl.float32)"
            )
    if k["reduce"] == "lanewise":  # per-lane partial sums, one reduction at the end
        acc_init = "acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)"
        acc_step = "acc += x * x"
        ss = "tl.sum(acc, axis=1)"
    else:  # reduce every chunk: no tile-sized accumulator held in registers
        acc_init = "ss = tl.zeros([ROWS], dtype=tl.float32)"
        acc_step = "ss += tl.sum(x * x, axis=1)"
        ss = "ss"
    body = f"""
rows = rb * ROWS + tl.arange(0, ROWS)
rmask = rows < M
rows = rows.to(tl.int64)
{acc_init}
for c0 in tl.range(0, N, BLOCK_N):
    cols = c0 + tl.arange(0, BLOCK_N)
    mask = rmask[:, None] & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0{p1}).to(tl.float32)
{mc.indent(pass1_add, 4) if fused else ""}    {acc_step}
rstd = {mc.rsqrt_expr(k["rsqrt"], ss + " / N + " + EPS)}
{barrier}
for c0 in tl.range(0, N, BLOCK_N):
    cols = c0 + tl.arange(0, BLOCK_N)
    cmask = cols < N
    mask = rmask[:, None] & cmask[None, :]
    w = tl.load(W + cols, mask=cmask, other=0.0{mc.load_kw(k["w_evict"])}).to(tl.float32)
{mc.indent(reload, 4)}    y = (x * rstd[:, None]) * w[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], _cast_out(y, Y.dtype.element_ty), mask=mask{skw})
"""
    body = "\n".join(line for line in body.splitlines() if line.strip())
    src = f"""


@triton.jit
def {name}({_kernel_args(fused)}, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
"""
    return src + mc.grid_loop(bool(k["persistent"]), "tl.cdiv(M, ROWS)", "rb", body)


# ---------------------------------------------------------------------------------
# launchers


def _launch_prologue(fused: bool, force_store: bool = False) -> str:
    if fused:
        force = "    store_residual = True  # the second pass re-reads the stored sum\n" if force_store else ""
        return (
            """


def run(x, residual, weight, store_residual=True):
    # store_residual=False: the sum x + residual is not stored (nor returned: None), for callers that do not use it
"""
            + force
            + """    assert x.dim() == 2 and residual.shape == x.shape and weight.dim() == 1
    assert weight.shape[0] == x.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if residual.stride(-1) != 1:
        residual = residual.contiguous()
    weight = weight.contiguous()
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    # y stands in for the residual output's pointer when it is not stored (the kernel never writes it then)
    ro = torch.empty((M, N), dtype=x.dtype, device=x.device) if store_residual else y
    if M == 0 or N == 0:
        return y, (ro if store_residual else None)
    args = (x, residual, weight, y, ro, M, N, x.stride(0), residual.stride(0), y.stride(0), ro.stride(0),
            bool(store_residual))
"""
        )
    return """


def run(x, weight):
    assert x.dim() == 2 and weight.dim() == 1 and weight.shape[0] == x.shape[1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    weight = weight.contiguous()
    M, N = x.shape
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    args = (x, weight, y, M, N, x.stride(0), y.stride(0))
"""


def _ret(fused: bool) -> str:
    return "    return y, (ro if store_residual else None)\n" if fused else "    return y\n"


def _render_rowblock(family: str, task: str, fused: bool, k: Mapping[str, Any]) -> str:
    fallback = {
        "pass1_evict": "evict_last",
        "pass2_evict": mc.policy_evict(k["x_load"]),
        "w_evict": k["w_evict"],
        "store_cache": k["store_cache"],
        "rsqrt": k["rsqrt"],
        "persistent": k["persistent"],
        "second_pass": "inputs",
        "reduce": "chunk",  # chunks as large as the register budget: keep no accumulator tile
    }
    kname = f"_{task}_rows_kernel"
    cname = f"_{task}_chunked_fallback_kernel"
    src = mc.header(family, f"{task}: whole rows in registers (rendered candidate).", k)
    src += mc.rowblock_constants_src(k)
    src += _rows_kernel(kname, fused, k)
    src += _chunked_kernel(cname, fused, fallback)
    src += _launch_prologue(fused)
    # Streams staged in shared memory when pipelined (fallback: pass 1 + pass 2 + weight).
    streams = 5 if fused else 3
    src += mc.rowblock_launch_src(kname, cname, "chunked two-pass kernel", streams, k["persistent"])
    return mc.finish(src + _ret(fused), k["num_stages"])


def _chunked_streams(fused: bool, k: Mapping[str, Any]) -> int:
    """Tiles loaded per chunk summed over both passes (weight counted as one)."""
    if not fused:
        return 3
    return 4 if k["second_pass"] == "residual_out" else 5


def _render_chunked(family: str, task: str, fused: bool, k: Mapping[str, Any]) -> str:
    kname = f"_{task}_chunked_kernel"
    src = mc.header(family, f"{task}: chunked two-pass rows (rendered candidate).", k)
    src += f"\nNUM_WARPS = {k['num_warps']}\nNUM_STAGES = {k['num_stages']}\n"
    src += f"ROWS_PER_PROGRAM = {k['rows']}\nBLOCK_N = {k['block_n']}\n"
    src += _chunked_kernel(kname, fused, k)
    src += _launch_prologue(fused, force_store=fused and k["second_pass"] == "residual_out")
    p = k["persistent"]
    src += f"""    block_n = min(BLOCK_N, triton.next_power_of_2(N))
{mc.clamp_block_src("block_n", "ROWS_PER_PROGRAM", _chunked_streams(fused, k), "x.element_size()")}\
    blocks = triton.cdiv(M, ROWS_PER_PROGRAM)
    grid = ({mc.grid_expr(p, "blocks", "x.device")},)
    {kname}[grid](*args, BLOCK_N=block_n, ROWS=ROWS_PER_PROGRAM, num_warps=NUM_WARPS, num_stages=NUM_STAGES)
"""
    return mc.finish(src + _ret(fused), k["num_stages"])


# ---------------------------------------------------------------------------------
# knob spaces

_RSQRT = Knob(
    "rsqrt",
    ("sqrt_div", "rsqrt"),
    "precision",
    "1/sqrt_rn (IEEE) or MUFU rsqrt.approx for the per-row scale",
)
_STORE_CACHE = mc.cache_knob("store_cache", ("", ".cs"), "store cache modifier (.cs: streaming)")
_W_EVICT = mc.evict_knob("w_evict", ("", "evict_last"), "eviction policy of the weight loads")


def _rowblock_knobs(fused: bool) -> tuple[Knob, ...]:
    knobs = [
        Knob("rows", (1, 2, 4, 8, 16, 32), "tiling", "rows per program step (clamped by the register budget)"),
        Knob(
            "max_elems_per_thread",
            (16, 32, 64, 128),
            "tiling",
            "register budget (fp32 elements per thread) of a [rows, next_pow2(N)] tile; "
            "longer rows take the chunked fallback",
        ),
        mc.warps_knob(),
        mc.persistent_knob(),
        mc.stages_knob(),
        mc.load_policy_knob("x_load", "row loads"),
        _W_EVICT,
        _STORE_CACHE,
        _RSQRT,
        mc.long_rows_knob(),
    ]
    if fused:
        knobs.append(
            Knob(
                "residual_store",
                ("late", "early"),
                "fusion",
                "store residual_out right after the add (early) or next to the normalised output (late)",
            )
        )
    return tuple(knobs)


def _chunked_knobs(fused: bool) -> tuple[Knob, ...]:
    knobs = [
        Knob(
            "block_n", (128, 256, 512, 1024, 2048, 4096, 8192, 16384), "tiling", "chunk width (clamped to next_pow2(N))"
        ),
        Knob("rows", (1, 2, 4, 8), "tiling", "rows per program step"),
        mc.warps_knob(),
        mc.stages_knob(),
        mc.persistent_knob(),
        Knob(
            "reduce",
            ("lanewise", "chunk"),
            "algorithmic",
            "sum of squares kept per lane and reduced once (a tile of fp32 registers) or reduced every chunk",
        ),
        mc.evict_knob(
            "pass1_evict",
            ("", "evict_last", "evict_first"),
            "eviction of first-pass loads (evict_last keeps the row in L2 for the re-read)",
        ),
        mc.evict_knob("pass2_evict", ("", "evict_first", "evict_last"), "eviction of second-pass loads"),
        _W_EVICT,
        _STORE_CACHE,
        _RSQRT,
    ]
    if fused:
        knobs.append(
            Knob(
                "second_pass",
                ("inputs", "residual_out"),
                "fusion",
                "second pass re-reads x and residual, or the residual_out just written "
                "(half the bytes; normalises the bf16-rounded sum)",
            )
        )
    return tuple(knobs)


def _rowblock_start(fused: bool) -> dict[str, Any]:
    s: dict[str, Any] = {
        "rows": 1,
        "max_elems_per_thread": 64,
        "num_warps": 4,
        "persistent": 0,
        "num_stages": 1,
        "x_load": "default",
        "w_evict": "",
        "store_cache": "",
        "rsqrt": "sqrt_div",
        "long_rows": "fallback",
    }
    if fused:
        s["residual_store"] = "late"
    return s


def _chunked_start(fused: bool) -> dict[str, Any]:
    s: dict[str, Any] = {
        "block_n": 1024,
        "rows": 1,
        "num_warps": 4,
        "num_stages": 1,
        "persistent": 0,
        "reduce": "lanewise",
        "pass1_evict": "",
        "pass2_evict": "",
        "w_evict": "",
        "store_cache": "",
        "rsqrt": "sqrt_div",
    }
    if fused:
        s["second_pass"] = "inputs"
    return s


def _rowblock_valid(k: Mapping[str, Any]) -> bool:
    # Without a persistent loop there is no loop to pipeline: keep one stages value.
    return bool(k["persistent"]) or k["num_stages"] == 1


def _chunked_valid_for(fused: bool):
    def valid(k: Mapping[str, Any]) -> bool:
        tile = k["block_n"] * k["rows"]
        ept = mc.elems_per_thread(tile, k["num_warps"])
        return 1 <= ept <= 128 and mc.fits_smem(k["num_stages"], tile, _chunked_streams(fused, k))

    return valid


def _make(task: str, fused: bool) -> list[Family]:
    rb_name, ch_name = f"{task}.rowblock", f"{task}.chunked"
    return [
        Family(
            name=rb_name,
            task=task,
            description="whole rows in registers, [rows, pow2(N)] tiles, optional persistent grid; "
            "chunked fallback for long rows",
            knobs=_rowblock_knobs(fused),
            start=_rowblock_start(fused),
            render=lambda k: _render_rowblock(rb_name, task, fused, k),
            valid=_rowblock_valid,
        ),
        Family(
            name=ch_name,
            task=task,
            description="two passes over BLOCK_N chunks (sum of squares, then normalise), re-reading the row",
            knobs=_chunked_knobs(fused),
            start=_chunked_start(fused),
            render=lambda k: _render_chunked(ch_name, task, fused, k),
            valid=_chunked_valid_for(fused),
        ),
    ]


FAMILIES: list[Family] = _make("rmsnorm", fused=False) + _make("fused_add_rmsnorm", fused=True)
