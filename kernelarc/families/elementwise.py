"""SwiGLU and RoPE families (memory-bound, elementwise).

SwiGLU (x [M, 2N] -> silu(x[:, :N]) * x[:, N:]):

- ``swiglu.tile2d``: one [ROWS, BLOCK_N] output tile per program step (column blocks
  fastest, so neighbouring programs stream neighbouring memory), optionally a persistent
  grid striding over tiles.
- ``swiglu.rowloop``: a program owns ROWS rows and walks their columns in BLOCK_N chunks
  (a software-pipelinable loop), optionally persistent over row blocks.

RoPE, NeoX rotate-half (q [T,H,D], k [T,Hkv,D], cos/sin [T, D/2] fp32):

- ``rope.fused_qk``: one launch; a program owns BLOCK_T tokens, loads their cos/sin once
  and loops over q heads and then k heads in blocks.
- ``rope.separate``: two launches (q, then k), each program one [BLOCK_T, BLOCK_H] tile of
  (token, head) rows, re-loading its cos/sin (L2 hits).

Both RoPE families rotate either by loading the two halves separately (``split``) or by
loading whole contiguous rows and splitting/joining them in registers (``join``; needs
D/2 a power of two, otherwise the launcher takes the split kernel rendered beside it).
All arithmetic in fp32; the cast happens at the store.
Both compile with ``enable_fp_fusion=False``: each product is rounded before the sum, as eager
PyTorch's ``x1 * cos - x2 * sin`` rounds it, so the rotated bf16 values match the reference's bit for bit
(a fused multiply-add changes the fp32 sum's last bit, and so about one bf16 value in 2^16; a problem whose
next step amplifies that, as a saturated softmax over large logits does, then reads those as wrong). The
kernels are memory-bound: separate multiply and add cost nothing measurable.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kernelarc.families import _mem_common as mc
from kernelarc.families.base import Family, Knob

# ---------------------------------------------------------------------------------
# SwiGLU


def _silu_expr(mode: str) -> str:
    if mode == "div_rn":
        return "tl.math.div_rn(g, 1.0 + tl.exp(-g))"
    if mode == "div":
        return "g / (1.0 + tl.exp(-g))"
    if mode == "sigmoid":
        return "g * tl.sigmoid(g)"
    raise ValueError(f"unknown silu mode {mode!r}")


def _swiglu_tile_body(k: Mapping[str, Any], cols_expr: str) -> str:
    gkw = mc.load_policy_kw(k["x_load"])
    skw = mc.store_kw(k["store_cache"])
    return f"""
cols = {cols_expr} + tl.arange(0, BLOCK_N)
mask = rmask[:, None] & (cols[None, :] < N)
g = tl.load(xrow + cols[None, :], mask=mask, other=0.0{gkw}).to(tl.float32)
u = tl.load(xrow + N + cols[None, :], mask=mask, other=0.0{gkw}).to(tl.float32)
y = ({_silu_expr(k["silu"])}) * u
tl.store(yrow + cols[None, :], _cast_out(y, Y.dtype.element_ty), mask=mask{skw})
"""


_ROWS_SETUP = """
rows = rb * ROWS + tl.arange(0, ROWS)
rmask = rows < M
rows = rows.to(tl.int64)
xrow = X + rows[:, None] * stride_x
yrow = Y + rows[:, None] * stride_y
"""


def _swiglu_tile_kernel(k: Mapping[str, Any]) -> str:
    body = (
        """
rb = t // num_cb
cb = t % num_cb"""
        + _ROWS_SETUP
        + _swiglu_tile_body(k, "cb * BLOCK_N")
    )
    src = """


@triton.jit
def _swiglu_tile_kernel(X, Y, M, N, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
    num_cb = tl.cdiv(N, BLOCK_N)
"""
    return src + mc.grid_loop(bool(k["persistent"]), "tl.cdiv(M, ROWS) * num_cb", "t", body)


def _swiglu_rowloop_kernel(k: Mapping[str, Any]) -> str:
    inner = _swiglu_tile_body(k, "c0")
    body = _ROWS_SETUP + "for c0 in tl.range(0, N, BLOCK_N):\n" + mc.indent(inner, 4)
    src = """


@triton.jit
def _swiglu_rowloop_kernel(X, Y, M, N, stride_x, stride_y, BLOCK_N: tl.constexpr, ROWS: tl.constexpr):
"""
    return src + mc.grid_loop(bool(k["persistent"]), "tl.cdiv(M, ROWS)", "rb", body)


_SWIGLU_PROLOGUE = """


def run(x):
    assert x.dim() == 2 and x.shape[1] % 2 == 0
    if x.stride(-1) != 1:
        x = x.contiguous()
    M = x.shape[0]
    N = x.shape[1] // 2
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    block_n = min(BLOCK_N, triton.next_power_of_2(N))
""" + mc.clamp_block_src("block_n", "ROWS_PER_PROGRAM", 2, "x.element_size()")


def _render_swiglu_tile(family: str, k: Mapping[str, Any]) -> str:
    src = mc.header(family, "swiglu: one output tile per program step (rendered candidate).", k)
    src += f"\nNUM_WARPS = {k['num_warps']}\nNUM_STAGES = {k['num_stages']}\n"
    src += f"ROWS_PER_PROGRAM = {k['rows']}\nBLOCK_N = {k['block_n']}\n"
    src += _swiglu_tile_kernel(k)
    src += (
        _SWIGLU_PROLOGUE
        + f"""    tiles = triton.cdiv(M, ROWS_PER_PROGRAM) * triton.cdiv(N, block_n)
    grid = ({mc.grid_expr(k["persistent"], "tiles", "x.device")},)
    _swiglu_tile_kernel[grid](x, y, M, N, x.stride(0), y.stride(0), BLOCK_N=block_n, ROWS=ROWS_PER_PROGRAM,
                              num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
"""
    )
    return mc.finish(src, k.get("num_stages", 1))


def _render_swiglu_rowloop(family: str, k: Mapping[str, Any]) -> str:
    src = mc.header(family, "swiglu: rows per program, column loop (rendered candidate).", k)
    src += f"\nNUM_WARPS = {k['num_warps']}\nNUM_STAGES = {k['num_stages']}\n"
    src += f"ROWS_PER_PROGRAM = {k['rows']}\nBLOCK_N = {k['block_n']}\n"
    src += _swiglu_rowloop_kernel(k)
    src += (
        _SWIGLU_PROLOGUE
        + f"""    blocks = triton.cdiv(M, ROWS_PER_PROGRAM)
    grid = ({mc.grid_expr(k["persistent"], "blocks", "x.device")},)
    _swiglu_rowloop_kernel[grid](x, y, M, N, x.stride(0), y.stride(0), BLOCK_N=block_n, ROWS=ROWS_PER_PROGRAM,
                                 num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return y
"""
    )
    return mc.finish(src, k.get("num_stages", 1))


def _swiglu_ept(k: Mapping[str, Any]) -> float:
    return mc.elems_per_thread(k["block_n"] * k["rows"], k["num_warps"])


def _swiglu_tile_valid(k: Mapping[str, Any]) -> bool:
    if not k["persistent"] and k["num_stages"] != 1:
        return False
    return 1 <= _swiglu_ept(k) <= 64 and mc.fits_smem(k["num_stages"], k["block_n"] * k["rows"], 2)


def _swiglu_rowloop_valid(k: Mapping[str, Any]) -> bool:
    return 1 <= _swiglu_ept(k) <= 64 and mc.fits_smem(k["num_stages"], k["block_n"] * k["rows"], 2)


def _swiglu_knobs() -> tuple[Knob, ...]:
    return (
        Knob(
            "block_n",
            (64, 128, 256, 512, 1024, 2048, 4096, 8192),
            "tiling",
            "output columns per tile (clamped to next_pow2(N))",
        ),
        Knob("rows", (1, 2, 4, 8, 16), "tiling", "rows per tile"),
        mc.warps_knob(),
        mc.stages_knob(),
        mc.persistent_knob(),
        mc.load_policy_knob("x_load", "gate/up loads"),
        mc.cache_knob("store_cache", ("", ".cs"), "store cache modifier (.cs: streaming)"),
        Knob(
            "silu",
            ("div_rn", "div", "sigmoid"),
            "precision",
            "silu(g) as g / (1 + exp(-g)) with IEEE division, approximate division, or g * tl.sigmoid(g)",
        ),
    )


_SWIGLU_START = {
    "block_n": 512,
    "rows": 1,
    "num_warps": 4,
    "num_stages": 1,
    "persistent": 0,
    "x_load": "default",
    "store_cache": "",
    "silu": "div_rn",
}

# ---------------------------------------------------------------------------------
# RoPE

_ROPE_ARGS = "T, HALF, sc_t, ss_t"


def _rope_rotate(k: Mapping[str, Any], X: str, XO: str, nh: str, bh: str, sx: str, so: str, join: bool) -> str:
    """Rotate heads [h0, h0 + bh) (masked by ``nh``) of tensor ``X`` for the current token block."""
    xkw = mc.load_policy_kw(k["x_load"])
    skw = mc.store_kw(k["store_cache"])
    head = f"""
h = h0 + tl.arange(0, {bh})
hmask = h < {nh}
m3 = tmask[:, None, None] & hmask[None, :, None] & dmask[None, None, :]
off = t64[:, None, None] * {sx}_t + h[None, :, None] * {sx}_h + d[None, None, :]
ooff = t64[:, None, None] * {so}_t + h[None, :, None] * {so}_h + d[None, None, :]
"""
    if not join:
        return (
            head
            + f"""x1 = tl.load({X} + off, mask=m3, other=0.0{xkw}).to(tl.float32)
x2 = tl.load({X} + off + HALF, mask=m3, other=0.0{xkw}).to(tl.float32)
o1 = x1 * c3 - x2 * s3
o2 = x2 * c3 + x1 * s3
tl.store({XO} + ooff, _cast_out(o1, {XO}.dtype.element_ty), mask=m3{skw})
tl.store({XO} + ooff + HALF, _cast_out(o2, {XO}.dtype.element_ty), mask=m3{skw})
"""
        )
    return (
        head
        + f"""x = tl.load({X} + off, mask=m3, other=0.0{xkw}).to(tl.float32)
x1, x2 = tl.split(tl.permute(tl.reshape(x, [BT, {bh}, 2, BD]), [0, 1, 3, 2]))
o1 = x1 * c3 - x2 * s3
o2 = x2 * c3 + x1 * s3
o = tl.reshape(tl.permute(tl.join(o1, o2), [0, 1, 3, 2]), [BT, {bh}, 2 * BD])
tl.store({XO} + ooff, _cast_out(o, {XO}.dtype.element_ty), mask=m3{skw})
"""
    )


def _head_loop(nh: str, bh: str, body: str) -> str:
    return f"for h0 in tl.range(0, {nh}, {bh}):\n" + mc.indent(body, 4)


def _rope_token_setup(k: Mapping[str, Any], join: bool) -> str:
    ckw = mc.load_kw(k["cs_evict"])
    if join:
        d = """
d = tl.arange(0, 2 * BD)
dmask = d < 2 * HALF
dc = tl.arange(0, BD)
dcmask = dc < HALF
"""
    else:
        d = """
d = tl.arange(0, BD)
dmask = d < HALF
dc = d
dcmask = dmask
"""
    return f"""
t = tb * BT + tl.arange(0, BT)
tmask = t < T
t64 = t.to(tl.int64)
{d.strip()}
cmask = tmask[:, None] & dcmask[None, :]
c3 = tl.load(COS + t64[:, None] * sc_t + dc[None, :], mask=cmask, other=0.0{ckw}).to(tl.float32)[:, None, :]
s3 = tl.load(SIN + t64[:, None] * ss_t + dc[None, :], mask=cmask, other=0.0{ckw}).to(tl.float32)[:, None, :]
"""


def _rope_fused_kernel(name: str, k: Mapping[str, Any], join: bool) -> str:
    body = (
        _rope_token_setup(k, join)
        + _head_loop("H", "BH", _rope_rotate(k, "Q", "QO", "H", "BH", "sq", "sqo", join))
        + _head_loop("HKV", "BHK", _rope_rotate(k, "K", "KO", "HKV", "BHK", "sk", "sko", join))
    )
    src = f"""


@triton.jit
def {name}(Q, K, COS, SIN, QO, KO, H, HKV, {_ROPE_ARGS},
           sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h,
           BT: tl.constexpr, BH: tl.constexpr, BHK: tl.constexpr, BD: tl.constexpr):
"""
    return src + mc.grid_loop(bool(k["persistent"]), "tl.cdiv(T, BT)", "tb", body)


def _rope_tile_kernel(name: str, k: Mapping[str, Any], join: bool) -> str:
    # One [BT, BH] (token, head) tile per program, head blocks fastest.
    body = (
        """
tb = pid // num_hb
h0 = (pid % num_hb) * BH"""
        + _rope_token_setup(k, join)
        + _rope_rotate(k, "X", "XO", "NH", "BH", "sx", "so", join)
    )
    src = f"""


@triton.jit
def {name}(X, COS, SIN, XO, NH, {_ROPE_ARGS}, sx_t, sx_h, so_t, so_h,
           BT: tl.constexpr, BH: tl.constexpr, BD: tl.constexpr):
    num_hb = tl.cdiv(NH, BH)
    pid = tl.program_id(0)
"""
    return src + mc.indent(body, 4)


_ROPE_PROLOGUE = """


def run(q, k, cos, sin):
    assert q.dim() == 3 and k.dim() == 3 and q.shape[0] == k.shape[0] and q.shape[2] == k.shape[2]
    T, H, D = q.shape
    HKV = k.shape[1]
    assert D % 2 == 0
    HALF = D // 2
    assert cos.shape == (T, HALF) and sin.shape == (T, HALF)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos.stride(-1) != 1:
        cos = cos.contiguous()
    if sin.stride(-1) != 1:
        sin = sin.contiguous()
    qo = torch.empty((T, H, D), dtype=q.dtype, device=q.device)
    ko = torch.empty((T, HKV, D), dtype=k.dtype, device=k.device)
    if T == 0 or D == 0:
        return qo, ko
    bd = triton.next_power_of_2(HALF)
"""


def _render_rope_fused(family: str, k: Mapping[str, Any]) -> str:
    join = k["halves"] == "join"
    src = mc.header(family, "rope: q and k in one launch, cos/sin loaded once per token block (rendered candidate).", k)
    src += f"\nNUM_WARPS = {k['num_warps']}\nNUM_STAGES = {k['num_stages']}\n"
    src += f"BLOCK_T = {k['block_t']}\nBLOCK_H = {k['block_h']}\nBLOCK_HKV = {k['block_hkv']}\n"
    src += _rope_fused_kernel("_rope_fused_split_kernel", k, join=False)
    if join:
        src += _rope_fused_kernel("_rope_fused_join_kernel", k, join=True)
    src += _ROPE_PROLOGUE
    pick = "_rope_fused_join_kernel if bd == HALF else _rope_fused_split_kernel" if join else "_rope_fused_split_kernel"
    src += f"""    blocks = triton.cdiv(T, BLOCK_T)
    grid = ({mc.grid_expr(k["persistent"], "blocks", "q.device")},)
    kernel = {pick}
    bh = min(BLOCK_H, triton.next_power_of_2(max(H, 1)))
    bhk = min(BLOCK_HKV, triton.next_power_of_2(max(HKV, 1)))
    # Pipelined head loops stage (token, head, D) tiles in shared memory: keep them in budget.
    row = 2 * bd * q.element_size()
    while NUM_STAGES > 1 and max(bh, bhk) > 1 and (NUM_STAGES - 1) * BLOCK_T * (bh + bhk) * row > {mc.SMEM_BUDGET}:
        if bh >= bhk:
            bh //= 2
        else:
            bhk //= 2
    kernel[grid](q, k, cos, sin, qo, ko, H, HKV, T, HALF, cos.stride(0), sin.stride(0),
                 q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                 qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1),
                 BT=BLOCK_T, BH=bh, BHK=bhk, BD=bd, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
                 enable_fp_fusion=False)
    return qo, ko
"""
    return mc.finish(src, k.get("num_stages", 1))


def _render_rope_separate(family: str, k: Mapping[str, Any]) -> str:
    join = k["halves"] == "join"
    src = mc.header(
        family, "rope: separate launches for q and k, one (token, head) tile per program (rendered candidate).", k
    )
    src += f"\nNUM_WARPS = {k['num_warps']}\n"
    src += f"BLOCK_T = {k['block_t']}\nBLOCK_H = {k['block_h']}\n"
    src += _rope_tile_kernel("_rope_tile_split_kernel", k, join=False)
    if join:
        src += _rope_tile_kernel("_rope_tile_join_kernel", k, join=True)
    src += _ROPE_PROLOGUE
    pick = "_rope_tile_join_kernel if bd == HALF else _rope_tile_split_kernel" if join else "_rope_tile_split_kernel"
    src += f"""    kernel = {pick}
    for x, xo in ((q, qo), (k, ko)):
        nh = x.shape[1]
        if nh == 0:
            continue
        bh = min(BLOCK_H, triton.next_power_of_2(nh))
        grid = (triton.cdiv(T, BLOCK_T) * triton.cdiv(nh, bh),)
        kernel[grid](x, cos, sin, xo, nh, T, HALF, cos.stride(0), sin.stride(0),
                     x.stride(0), x.stride(1), xo.stride(0), xo.stride(1),
                     BT=BLOCK_T, BH=bh, BD=bd, num_warps=NUM_WARPS, enable_fp_fusion=False)
    return qo, ko
"""
    return mc.finish(src, k.get("num_stages", 1))


def _rope_fused_valid(k: Mapping[str, Any]) -> bool:
    # (token, head) rows per tile against the threads: at D=128 a row is 4 fp32 per 32 threads.
    threads_rows = 32 * k["num_warps"]
    if k["block_t"] * max(k["block_h"], k["block_hkv"]) > threads_rows:
        return False
    # staged head tiles at D = 128 (the largest head dim of the task's workloads)
    return mc.fits_smem(k["num_stages"], k["block_t"] * (k["block_h"] + k["block_hkv"]) * 128, 1)


def _rope_separate_valid(k: Mapping[str, Any]) -> bool:
    return k["block_t"] * k["block_h"] <= 32 * k["num_warps"]


_HALVES = Knob(
    "halves",
    ("split", "join"),
    "algorithmic",
    "load/store the two halves separately, or whole rows split/joined in registers (D/2 a power of two)",
)
_CS_EVICT = mc.evict_knob("cs_evict", ("", "evict_last", "evict_first"), "eviction policy of the cos/sin loads")
_ROPE_X_LOAD = mc.load_policy_knob("x_load", "q/k loads")
_ROPE_STORE = mc.cache_knob("store_cache", ("", ".cs"), "store cache modifier (.cs: streaming)")
_BLOCK_T = Knob("block_t", (1, 2, 4, 8, 16, 32), "tiling", "tokens per program step")


FAMILIES: list[Family] = [
    Family(
        name="swiglu.tile2d",
        task="swiglu",
        description="one [rows, block_n] output tile per program step, column blocks fastest; optional persistent grid",
        knobs=_swiglu_knobs(),
        start=dict(_SWIGLU_START),
        render=lambda k: _render_swiglu_tile("swiglu.tile2d", k),
        valid=_swiglu_tile_valid,
    ),
    Family(
        name="swiglu.rowloop",
        task="swiglu",
        description="a program owns rows and loops over their columns in chunks; optional persistent grid",
        knobs=_swiglu_knobs(),
        start=dict(_SWIGLU_START),
        render=lambda k: _render_swiglu_rowloop("swiglu.rowloop", k),
        valid=_swiglu_rowloop_valid,
    ),
    Family(
        name="rope.fused_qk",
        task="rope",
        description="q and k in one launch: token block per program, cos/sin loaded once, loops over head blocks",
        knobs=(
            _BLOCK_T,
            Knob("block_h", (1, 2, 4, 8, 16, 32, 64), "tiling", "q heads per inner step (clamped to next_pow2(H))"),
            Knob("block_hkv", (1, 2, 4, 8, 16), "tiling", "k heads per inner step (clamped to next_pow2(Hkv))"),
            mc.warps_knob(),
            mc.stages_knob(),
            mc.persistent_knob(),
            _HALVES,
            _ROPE_X_LOAD,
            _CS_EVICT,
            _ROPE_STORE,
        ),
        start={
            "block_t": 1,
            "block_h": 4,
            "block_hkv": 1,
            "num_warps": 4,
            "num_stages": 1,
            "persistent": 0,
            "halves": "split",
            "x_load": "default",
            "cs_evict": "",
            "store_cache": "",
        },
        render=lambda k: _render_rope_fused("rope.fused_qk", k),
        valid=_rope_fused_valid,
    ),
    Family(
        name="rope.separate",
        task="rope",
        description="separate q and k launches, one (token block, head block) tile per program",
        knobs=(
            _BLOCK_T,
            Knob("block_h", (1, 2, 4, 8, 16, 32, 64), "tiling", "heads per tile (clamped to next_pow2(heads))"),
            mc.warps_knob(),
            _HALVES,
            _ROPE_X_LOAD,
            _CS_EVICT,
            _ROPE_STORE,
        ),
        start={
            "block_t": 1,
            "block_h": 4,
            "num_warps": 4,
            "halves": "split",
            "x_load": "default",
            "cs_evict": "",
            "store_cache": "",
        },
        render=lambda k: _render_rope_separate("rope.separate", k),
        valid=_rope_separate_valid,
    ),
]
