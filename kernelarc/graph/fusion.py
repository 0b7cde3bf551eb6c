"""Fused regions: connected elementwise ops with row and column reductions, as one generated Triton kernel.

A *region* is a set of graph nodes whose values all live on one anchor shape ``(R..., H)`` (``H`` the last
axis): every value is either the whole anchor (``full``), one value per row (``row``: ``(R..., 1)``), one per
column (``col``: ``(H,)`` or ``(1.., H)``) or one in all (``scalar``). Its ops are pointwise ops (the aten ops
torch tags pointwise that KernelArc can write in Triton: arithmetic, exp / log / tanh / sigmoid / erf,
comparisons, where / masked_fill, clamps, casts) and reductions of a ``full`` value over the last axis (a
``row`` value the region may read again, as RMSNorm's mean or a softmax's max), over the leading axes (a
weight's gradient: ``sum(dim=(0, 1))``) or over everything (a scalar loss).

KernelArc writes one kernel per region (``render_fused``): persistent programs walk blocks of rows, each
row is loaded once into registers, every op and row reduction runs there, column and full reductions are
accumulated per program and summed after the kernel. That is the fusion Inductor does not do across a row
and a column reduction (a norm's backward: the input gradient per row and the weight gradient per column in
one pass over the saved tensors, not two), and one launch where the eager graph makes one per op.

Each op's result is rounded to its dtype as the reference's eager op rounds it (a bf16 op's value is a bf16
value), and reductions accumulate in fp32 as torch's do. Anything else (views, int tensors, fp64, other
broadcasts, a value read outside the region before the region ends) leaves the node outside the region, to
the rest of the graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import node_dtype, node_shape, static_int
from kernelarc.graph.patterns import Kind, Site, arg, op

# Rows of at most this many elements are held in registers (BLOCK_H, a power of two); wider rows run the
# region's own graph ops.
MAX_H = 16384
FAMILY = "fused.rowblock"
# NUM_WARPS 'auto': the warps for a row block of E elements, by (below this many elements, warps), else the last
AUTO_WARPS = ((2048, 4), (8192, 8), (None, 16))
AUTO_WARPS_EXPR = "(" + " else ".join(f"{w} if E < {e}" if e else f"{w}" for e, w in AUTO_WARPS) + ")"


def auto_warps(elements: int) -> int:
    """The warps the rendered ``run`` launches a row block of ``elements`` with under NUM_WARPS 'auto'."""
    return next(w for e, w in AUTO_WARPS if e is None or elements < e)


class Role(StrEnum):
    full = "full"  # the anchor's shape
    row = "row"  # (R..., 1): one value per row, broadcast along H
    col = "col"  # (H,) with leading 1s: one value per column
    scalar = "scalar"  # one value
    # reduction results, outputs only (the region does not read them back)
    rowflat = "rowflat"  # (R...): a last-axis reduction without keepdim
    colred = "colred"  # over the leading axes
    allred = "allred"  # over every axis


FLOATS = {torch.float32, torch.bfloat16, torch.float16}
LOW = {torch.bfloat16: "tl.bfloat16", torch.float16: "tl.float16"}
TRANSPARENT = {"clone", "contiguous", "alias", "detach", "lift_fresh_copy"}
CASTS = {"to", "_to_copy", "type_as"}
# reductions over the last axis only (a row's statistics): variance and standard deviation (any correction), the
# log of the sum of exponentials, the Euclidean norm
ROW_ONLY = {"var", "std", "logsumexp", "linalg_vector_norm"}
REDUCE = {"sum", "mean", "amax", "amin"} | ROW_ONLY

# pointwise ops as Triton expressions of their operands (fp32 values, bool masks)
_UNARY = {
    "neg": "-({0})",
    "exp": "tl.exp({0})",
    "log": "tl.log({0})",
    "sqrt": "tl.sqrt_rn({0})",
    "rsqrt": "(1.0 / tl.sqrt_rn({0}))",
    "reciprocal": "(1.0 / ({0}))",
    "abs": "tl.abs({0})",
    "sin": "tl.sin({0})",
    "cos": "tl.cos({0})",
    "sigmoid": "tl.sigmoid({0})",
    "silu": "(({0}) * tl.sigmoid({0}))",
    "relu": "tl.maximum({0}, 0.0)",
    "erf": "tl.erf({0})",
    "tanh": "_tanh({0})",
    "square": "(({0}) * ({0}))",
    "exp2": "tl.exp2({0})",
    "log2": "tl.log2({0})",
    "floor": "tl.floor({0})",
    "ceil": "tl.ceil({0})",
    "bitwise_not": "(({0}) == 0)",
    "logical_not": "(({0}) == 0)",
}
_BINARY = {
    "mul": "(({0}) * ({1}))",
    "div": "(({0}) / ({1}))",
    "maximum": "tl.maximum({0}, {1})",
    "minimum": "tl.minimum({0}, {1})",
    "eq": "(({0}) == ({1}))",
    "ne": "(({0}) != ({1}))",
    "lt": "(({0}) < ({1}))",
    "le": "(({0}) <= ({1}))",
    "gt": "(({0}) > ({1}))",
    "ge": "(({0}) >= ({1}))",
    "bitwise_and": "(({0}) & ({1}))",
    "bitwise_or": "(({0}) | ({1}))",
    "logical_and": "(({0}) & ({1}))",
    "logical_or": "(({0}) | ({1}))",
}
_OTHER = {"add", "sub", "rsub", "pow", "where", "masked_fill", "clamp", "clamp_min", "clamp_max", "gelu"}
POINTWISE = set(_UNARY) | set(_BINARY) | _OTHER | TRANSPARENT | CASTS


@dataclass
class Region:
    """One fused region of a graph: its nodes in graph order, inputs, outputs and the anchor."""

    rank: int
    H: int | None  # the row width as traced (None: symbolic with no traced value)
    nodes: list[Node]
    inputs: list[Node] = field(default_factory=list)  # tensor values read from outside, in first-use order
    outputs: list[Node] = field(default_factory=list)  # region nodes read outside it, in graph order
    roles: dict[Node, Role] = field(default_factory=dict)

    def describe(self) -> str:
        red = sum(op(n) in REDUCE for n in self.nodes)
        return f"{len(self.nodes)} ops, {red} reductions, H={self.H}, {len(self.inputs)} in, {len(self.outputs)} out"


# ------------------------------------------------------------------------------------------
# recognition


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(a == b) if not isinstance(a, torch.SymInt) and not isinstance(b, torch.SymInt) else str(a) == str(b)
    except Exception:  # noqa: BLE001 - an undecidable symbolic comparison: not the same
        return False


def _is_one(a: Any) -> bool:
    return static_int(a) == 1


def shape_role(shape: tuple | None, anchor: tuple) -> Role | None:
    """The role of a value of ``shape`` broadcast against ``anchor`` (None: another broadcast)."""
    if shape is None or len(shape) > len(anchor):
        return None
    pad = (1,) * (len(anchor) - len(shape)) + tuple(shape)
    lead_same = all(_same(a, b) for a, b in zip(pad[:-1], anchor[:-1], strict=True))
    lead_one = all(_is_one(a) for a in pad[:-1])
    last_h, last_one = _same(pad[-1], anchor[-1]), _is_one(pad[-1])
    if lead_one and last_one:
        return Role.scalar
    if lead_same and last_h:
        return Role.full
    if lead_same and last_one:
        return Role.row
    if lead_one and last_h:
        return Role.col
    return None


def _dims(n: Node, rank: int) -> tuple[set[int] | None, bool]:
    """The axes a reduction node reduces (None: all) and its keepdim."""
    name = op(n)
    if len(n.args) == 1 and not n.kwargs.get("dim"):
        return None, False
    dim = arg(n, 1, "dim")
    keep = bool(arg(n, 2, "keepdim", False))
    if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0 and name in ("amax", "amin", "sum", "mean")):
        return None, keep
    dims = dim if isinstance(dim, list | tuple) else [dim]
    if not all(isinstance(d, int) for d in dims):
        return set(), keep
    return {d % rank for d in dims}, keep


def _reduction_role(n: Node, anchor: tuple) -> Role | None:
    rank = len(anchor)
    if op(n) not in REDUCE or not isinstance(n.args[0], Node) or node_shape(n.args[0]) is None:
        return None
    if shape_role(node_shape(n.args[0]), anchor) is not Role.full or len(node_shape(n.args[0])) != rank:
        return None
    if n.kwargs.get("dtype") is not None and n.kwargs["dtype"] not in FLOATS:
        return None
    if op(n) in ROW_ONLY:
        row = _row_only(n, rank)
        return None if row is None else (Role.row if row[0] else Role.rowflat)
    dims, keep = _dims(n, rank)
    if dims is None or dims == set(range(rank)):
        return Role.allred
    if dims == {rank - 1}:
        return Role.row if keep else Role.rowflat
    if dims == set(range(rank - 1)) and dims:
        return Role.colred
    return None


def _row_only(n: Node, rank: int) -> tuple[bool, float] | None:
    """(keepdim, correction) of a ``ROW_ONLY`` reduction over the last axis (correction: var / std's; the norm's
    order must be 2); None for another form."""
    name = op(n)
    overload = getattr(n.target, "_overloadname", "")
    corr = 0.0
    if name == "linalg_vector_norm":
        if float(arg(n, 1, "ord", 2)) != 2.0:
            return None
        dim, keep = arg(n, 2, "dim"), arg(n, 3, "keepdim", False)
    elif name == "logsumexp":
        dim, keep = arg(n, 1, "dim"), arg(n, 2, "keepdim", False)
    elif overload == "correction":  # var / std (x, dim, *, correction, keepdim)
        dim, keep = arg(n, 1, "dim"), n.kwargs.get("keepdim", False)
        c = n.kwargs.get("correction")
        corr = 1.0 if c is None else float(c)
    elif overload == "dim":  # var / std (x, dim, unbiased, keepdim)
        dim, keep = arg(n, 1, "dim"), arg(n, 3, "keepdim", False)
        corr = 1.0 if arg(n, 2, "unbiased", True) else 0.0
    else:
        return None
    dims = dim if isinstance(dim, list | tuple) else [dim]
    if len(dims) != 1 or not isinstance(dims[0], int) or dims[0] % rank != rank - 1:
        return None
    return bool(keep), corr


def _pointwise_ok(n: Node) -> bool:
    """An op of a form the codegen writes (operands tensors of the region or literals)."""
    name = op(n)
    if name not in POINTWISE:
        return False
    if name in CASTS:
        dt = n.kwargs.get("dtype", n.args[1] if len(n.args) > 1 else None)
        if name == "type_as":
            dt = node_dtype(n)
        if not isinstance(dt, torch.dtype) or dt not in FLOATS | {torch.bool}:
            return False
        extra = {k: v for k, v in n.kwargs.items() if k not in ("dtype", "copy", "non_blocking", "memory_format")}
        if extra or any(isinstance(a, torch.device) for a in n.args[1:]):
            return False
        return len(n.args) <= 2 or name == "type_as"
    if (
        name == "pow"
        and not (isinstance(n.args[0], Node) and _pow_exponent(n.args[1]) is not None)
        and not (isinstance(n.args[0], int | float) and not isinstance(n.args[0], bool) and n.args[0] > 0)
    ):
        return False
    if name == "gelu" and n.kwargs.get("approximate", arg(n, 1, "approximate", "none")) not in ("none", "tanh"):
        return False
    if name == "div" and n.kwargs.get("rounding_mode") is not None:
        return False
    for a in [*n.args, *(v for k, v in n.kwargs.items() if k in ("alpha", "min", "max", "other"))]:
        if isinstance(a, Node):
            if node_dtype(a) not in FLOATS | {torch.bool}:
                return False
        elif a is not None and not isinstance(a, bool | int | float | str):
            return False
    return node_dtype(n) in FLOATS | {torch.bool}


# x ** e for the exponents written without pow (exact where torch's pow is exact)
_POW = {-1.0: "(1.0 / ({0}))", -0.5: "(1.0 / tl.sqrt_rn({0}))", 0.5: "tl.sqrt_rn({0})", 1.0: "({0})",
        2.0: "(({0}) * ({0}))", 3.0: "(({0}) * ({0}) * ({0}))", 4.0: "(({0}) * ({0}) * ({0}) * ({0}))"}  # fmt: skip


def _pow_exponent(e: Any) -> float | None:
    if isinstance(e, bool) or not isinstance(e, int | float):
        return None
    return float(e) if float(e) in _POW else None


def layer_norm_ok(n: Node) -> bool:
    """``n`` is an ``aten.layer_norm`` the region kernels compute (over the last axis only, a float input, weight
    and bias absent or 1-D, a numeric eps): a row op, its statistics from the row held in registers."""
    if op(n) != "layer_norm" or not isinstance(n.args[0], Node):
        return False
    shape = arg(n, 1, "normalized_shape")
    if not isinstance(shape, list | tuple) or len(shape) != 1 or node_dtype(n.args[0]) not in FLOATS:
        return False
    eps = arg(n, 4, "eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, int | float):
        return False
    for w in (arg(n, 2, "weight"), arg(n, 3, "bias")):
        if w is not None and (not isinstance(w, Node) or node_dtype(w) not in FLOATS or len(node_shape(w) or ()) != 1):
            return False
    return node_dtype(n) in FLOATS


def _data_inputs(n: Node) -> list[Node]:
    """The tensors ``n`` reads (a LayerNorm's normalized_shape may hold a symbolic size node: not data)."""
    if op(n) == "layer_norm":
        return [a for a in (n.args[0], arg(n, 2, "weight"), arg(n, 3, "bias")) if isinstance(a, Node)]
    return list(n.all_input_nodes)


def _admit(n: Node, anchor: tuple) -> Role | None:
    """The role of node ``n`` in a region on ``anchor`` (None: it stays outside)."""
    if op(n) == "layer_norm":
        if not layer_norm_ok(n) or len(node_shape(n.args[0]) or ()) != len(anchor):
            return None
        if any(shape_role(node_shape(x), anchor) is not Role.full for x in (n.args[0], n)):
            return None
        if any(shape_role(node_shape(w), anchor) is not Role.col for w in _data_inputs(n)[1:]):
            return None
        return Role.full
    if op(n) in REDUCE:
        return _reduction_role(n, anchor) if node_dtype(n) in FLOATS else None
    if not _pointwise_ok(n):
        return None
    role = shape_role(node_shape(n), anchor)
    if role is None:
        return None
    for a in n.all_input_nodes:
        if shape_role(node_shape(a), anchor) is None:
            return None
    return role


def _grow(seed: Node, anchor: tuple, taken: set[Node]) -> dict[Node, Role]:
    roles: dict[Node, Role] = {}
    todo = [seed]
    while todo:
        m = todo.pop()
        if m in roles or m in taken or m.op != "call_function":
            continue
        role = _admit(m, anchor)
        if role is None:
            continue
        roles[m] = role
        todo += list(m.all_input_nodes) + list(m.users)
        # siblings: other ops reading the same full-size value (an input, or a value computed outside) read it from
        # the same registers, once (L1/061's gradient and its clone of grad_output)
        for a in m.all_input_nodes:
            outside = a.op != "call_function" or _admit(a, anchor) is None
            if outside and shape_role(node_shape(a), anchor) is Role.full:
                todo += list(a.users)
    return roles


def _prune(roles: dict[Node, Role], order: dict[Node, int], cut: bool) -> None:
    """Drop nodes the kernel cannot serve as placed, to a fixpoint: ops reading a reduction that is an output
    only; values other than full or row values or reductions that the graph reads outside the region; and where
    the graph reads a region's value before the region's last node (where the region is computed), either the
    nodes after that read (``cut``) or the values read early (they become inputs, computed where they are)."""
    changed = True
    while changed and roles:
        changed = False
        out_only = {Role.rowflat, Role.colred, Role.allred}
        for n in list(roles):
            if any(a in roles and roles[a] in out_only for a in n.all_input_nodes):
                del roles[n]
                changed = True
        for n in list(roles):
            outside = [u for u in n.users if u not in roles]
            if outside and roles[n] in (Role.col, Role.scalar):
                del roles[n]
                changed = True
        if changed or not roles:
            continue  # the role rules to their fixpoint first: a node they drop may be the one read early
        last = max(order[n] for n in roles)
        early = {n: [order[u] for u in n.users if u not in roles and order[u] < last] for n in roles}
        early = {n: min(reads) for n, reads in early.items() if reads}
        if not early:
            continue
        at = min(early.values())
        for n in [n for n in roles if order[n] > at] if cut else list(early):
            del roles[n]
        changed = True


def _best_pruned(roles: dict[Node, Role], order: dict[Node, int]) -> dict[Node, Role]:
    """The larger (in compute ops) of the two ways ``_prune`` places a region read early."""
    kept = []
    for cut in (True, False):
        r = dict(roles)
        _prune(r, order, cut)
        kept.append(r)
    return max(kept, key=lambda r: sum(_compute(n) for n in r))


def _compute(n: Node) -> bool:
    return op(n) not in TRANSPARENT | CASTS


def _hint(x: Any) -> int | None:
    """An axis's size: its value, or for a symbolic size the value it was traced with (None if unknown)."""
    v = static_int(x)
    if v is None and isinstance(x, torch.SymInt):
        hint = getattr(x.node, "hint", None)
        v = int(hint) if isinstance(hint, int) else None
    return v


def fused_regions(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Region]:
    """The fused regions of ``gm`` among nodes not in ``taken``, in graph order of their seeds."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    used: set[Node] = set(taken)
    out: list[Region] = []
    for seed in gm.graph.nodes:
        if seed in used or seed.op != "call_function" or op(seed) in REDUCE:
            continue
        if not _pointwise_ok(seed) and not layer_norm_ok(seed):
            continue
        anchor = node_shape(seed)
        if not anchor:
            continue
        h = _hint(anchor[-1])
        if h is not None and not 1 <= h <= MAX_H:
            continue
        roles = _best_pruned(_grow(seed, anchor, used), order)
        # a LayerNorm is many ops in one node: a region of it alone (and casts) is one kernel too
        if not any(r is Role.full for r in roles.values()) or sum(_compute(n) for n in roles) < 2 - any(
            op(n) == "layer_norm" for n in roles
        ):
            continue
        nodes = sorted(roles, key=order.__getitem__)
        inputs: list[Node] = []
        for n in nodes:
            for a in _data_inputs(n):
                if a not in roles and a not in inputs:
                    inputs.append(a)
        outputs = [n for n in nodes if any(u not in roles for u in n.users)]
        if not outputs:
            continue
        region = Region(len(anchor), h, nodes, inputs, outputs, roles)
        for a in inputs:  # every input has a role: _admit checked each op's inputs
            region.roles[a] = shape_role(node_shape(a), anchor)
        used.update(nodes)
        out.append(region)
    return out


def fused_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    sites = []
    for r in fused_regions(gm, taken):
        last = r.nodes[-1]
        extra = {f"out{i}": n for i, n in enumerate(r.outputs) if n is not last}
        inputs = {f"in{i}": a for i, a in enumerate(r.inputs)}
        params = {"ops": len(r.nodes), "H": r.H, "reductions": sum(op(n) in REDUCE for n in r.nodes), "_region": r}
        sites.append(Site(Kind.fused, last, set(r.nodes), inputs, params, extra))
    return sites


# ------------------------------------------------------------------------------------------
# code generation


def _lit(a: Any) -> str:
    if isinstance(a, bool):
        return "True" if a else "False"
    v = float(a)
    if math.isnan(v):
        return 'float("nan")'
    if math.isinf(v):
        return 'float("inf")' if v > 0 else '(-float("inf"))'
    return repr(v)


class _Writer:
    def __init__(self, region: Region) -> None:
        self.r = region
        self.names: dict[Node, str] = {}
        self.hoisted: list[str] = []  # loads outside the row loop (columns, scalars)
        self.body: list[str] = []  # per row block
        self.acc_init: list[str] = []
        self.after: list[str] = []  # partial stores
        self.params: list[str] = []  # the kernel's parameters
        self.args: list[str] = []  # what ``run`` passes for each of them
        self.partials: dict[int, bool] = {}  # node index -> one partial per program (full sum) or a row of them

    def param(self, name: str, arg: str | None = None) -> None:
        self.params.append(name)
        self.args.append(arg or name)

    def val(self, a: Any) -> str:
        if isinstance(a, Node):
            return self.names[a]
        return _lit(a)

    def _round(self, n: Node, expr: str) -> str:
        dt = node_dtype(n)
        if dt in LOW:
            return f"_cast_out({expr}, {LOW[dt]}).to(tl.float32)"
        return expr

    def load(self, i: int, a: Node) -> None:
        role = self.r.roles[a]
        name = f"x{i}"
        conv = "" if node_dtype(a) is torch.bool else ".to(tl.float32)"
        self.param(f"p{i}", f"v{i}")  # v{i}: run's view of input i ([R, H], [R], [H] or [])
        if role is Role.full:
            self.param(f"sr{i}", f"v{i}.stride(0)")
            self.param(f"sc{i}", f"v{i}.stride(1)")
            self.body.append(f"{name} = tl.load(p{i} + rows64 * sr{i} + cols64 * sc{i}, mask=m, other=0){conv}")
        elif role is Role.row:
            self.param(f"sr{i}", f"v{i}.stride(0)")
            self.body.append(f"{name} = tl.load(p{i} + rows64 * sr{i}, mask=rm2, other=0){conv}")
        elif role is Role.col:
            self.param(f"sc{i}", f"v{i}.stride(0)")
            self.hoisted.append(f"{name} = tl.load(p{i} + cols64 * sc{i}, mask=cm2, other=0){conv}")
        else:
            self.hoisted.append(f"{name} = tl.load(p{i}){conv}")
        self.names[a] = name

    def node(self, j: int, n: Node) -> None:
        name = op(n)
        v = f"t{j}"
        args = n.args
        if name in REDUCE:
            self._reduce(j, n)
            return
        if name in TRANSPARENT:
            self.names[n] = self.val(args[0])
            return
        if name == "layer_norm":  # fp32 statistics of the row held in registers, as torch's kernel takes them
            x, w, b = self.val(args[0]), arg(n, 2, "weight"), arg(n, 3, "bias")
            eps = float(arg(n, 4, "eps", 1e-5))
            self.body += [
                f"{v}_mu = tl.sum(tl.where(m, {x}, 0.0), axis=1)[:, None] / H",
                f"{v}_d = tl.where(m, ({x}) - {v}_mu, 0.0)",
                f"{v}_rs = 1.0 / tl.sqrt_rn(tl.sum({v}_d * {v}_d, axis=1)[:, None] / H + {eps!r})",
            ]
            expr = f"({v}_d * {v}_rs)"
            if w is not None:
                expr = f"({expr} * {self.val(w)})"
            if b is not None:
                expr = f"({expr} + {self.val(b)})"
            self.body.append(f"{v} = {self._round(n, expr)}")
            self.names[n] = v
            return
        if name in CASTS:
            src = self.val(args[0])
            dt = node_dtype(n)
            if dt is torch.bool:
                expr = f"({src} != 0)"
            elif node_dtype(args[0]) is torch.bool:
                expr = f"{src}.to(tl.float32)"
            else:
                expr = self._round(n, src)
            self.body.append(f"{v} = {expr}")
            self.names[n] = v
            return
        a = [self.val(x) for x in args]
        if name in _UNARY:
            expr = _UNARY[name].format(a[0])
        elif name in _BINARY:
            expr = _BINARY[name].format(a[0], a[1])
        elif name in ("add", "sub"):
            alpha = n.kwargs.get("alpha", 1)
            b = a[1] if alpha == 1 else f"({a[1]} * {_lit(alpha)})"
            expr = f"(({a[0]}) {'+' if name == 'add' else '-'} ({b}))"
        elif name == "rsub":
            alpha = n.kwargs.get("alpha", 1)
            b = a[0] if alpha == 1 else f"({a[0]} * {_lit(alpha)})"
            expr = f"(({a[1]}) - ({b}))"
        elif name == "pow":
            if isinstance(args[0], Node):
                expr = _POW[_pow_exponent(args[1])].format(a[0])
            else:
                expr = f"tl.exp2(({a[1]}) * {math.log2(float(args[0]))!r})"
        elif name == "where":
            expr = f"tl.where({a[0]}, {a[1]}, {a[2]})"
        elif name == "masked_fill":
            expr = f"tl.where({a[1]}, {a[2]}, {a[0]})"
        elif name in ("clamp", "clamp_min", "clamp_max"):
            lo = arg(n, 1, "min") if name != "clamp_max" else None
            hi = (arg(n, 2, "max") if name == "clamp" else arg(n, 1, "max")) if name != "clamp_min" else None
            expr = a[0]
            if lo is not None:
                expr = f"tl.maximum({expr}, {self.val(lo)})"
            if hi is not None:
                expr = f"tl.minimum({expr}, {self.val(hi)})"
        elif name == "gelu":
            x = a[0]
            if n.kwargs.get("approximate", arg(n, 1, "approximate", "none")) == "tanh":
                expr = f"(0.5 * ({x}) * (1.0 + _tanh(0.7978845608028654 * (({x}) + 0.044715 * ({x}) * ({x}) * ({x})))))"
            else:
                expr = f"(0.5 * ({x}) * (1.0 + tl.erf(({x}) * 0.7071067811865476)))"
        else:  # pragma: no cover - _pointwise_ok admits only the ops above
            raise ValueError(f"fused region: no Triton form for {name}")
        if node_dtype(n) is not torch.bool:
            expr = self._round(n, expr)
        self.body.append(f"{v} = {expr}")
        self.names[n] = v

    def _row_stat(self, j: int, n: Node, src: str) -> None:
        v = f"t{j}"
        row = _row_only(n, self.r.rank)
        assert row is not None
        self.body += _row_stat_lines(op(n), v, src, row[1])
        self.body.append(f"{v} = {self._round(n, v)}")
        self.names[n] = v

    def _reduce(self, j: int, n: Node) -> None:
        name = op(n)
        src = self.val(n.args[0])
        if name in ROW_ONLY:
            self._row_stat(j, n, src)
            return
        role = self.r.roles[n]
        fill = '(-float("inf"))' if name == "amax" else ('float("inf")' if name == "amin" else "0.0")
        red = {"amax": "tl.max", "amin": "tl.min"}.get(name, "tl.sum")
        masked = f"tl.where(m, {src}, {fill})"
        v = f"t{j}"
        if role in (Role.row, Role.rowflat):
            expr = f"{red}({masked}, axis=1)[:, None]"
            if name == "mean":
                expr = f"({expr} / H)"
            self.body.append(f"{v} = {self._round(n, expr)}")
            self.names[n] = v
            return
        # column and full reductions: a partial per program, summed after the kernel. The program's rows are
        # accumulated element by element in a [TILE_R, BLOCK_H] block and reduced across rows once, after its loop
        # (a reduction across the tile's rows every iteration is a cross-warp exchange each time; Inductor's looped
        # reductions keep such a block too)
        acc = f"acc{j}"
        self.acc_init.append(f"{acc} = tl.full([TILE_R, BLOCK_H], {fill}, tl.float32)")
        if name in ("amax", "amin"):
            combine = "tl.maximum" if name == "amax" else "tl.minimum"
            self.body.append(f"{acc} = {combine}({acc}, {masked})")
        else:
            self.body.append(f"{acc} = {acc} + {masked}")
        self.param(f"q{j}")
        self.partials[j] = role is Role.allred
        if role is Role.allred:  # one value per program
            self.after.append(f"tl.store(q{j} + pid, {red}({red}({acc}, axis=1), axis=0))")
        else:
            self.after.append(
                f"tl.store(q{j} + pid * BLOCK_H + cols[None, :], {red}({acc}, axis=0)[None, :], mask=cm2)"
            )
        self.names[n] = acc


def _row_stat_lines(name: str, v: str, src: str, corr: float) -> list[str]:
    """Lines computing a row statistic ``v`` ([TILE_R, 1]) of the row block ``src`` (masked lanes left out)."""
    if name == "linalg_vector_norm":
        return [f"{v} = tl.sqrt_rn(tl.sum(tl.where(m, ({src}) * ({src}), 0.0), axis=1)[:, None])"]
    if name == "logsumexp":  # rows of -inf give -inf, as torch's
        return [
            f"{v}_m = tl.max(tl.where(m, {src}, -float('inf')), axis=1)[:, None]",
            f"{v}_m = tl.where({v}_m == -float('inf'), 0.0, {v}_m)",
            f"{v} = {v}_m + tl.log(tl.sum(tl.where(m, tl.exp(({src}) - {v}_m), 0.0), axis=1)[:, None])",
        ]
    lines = [  # two passes over the row held in registers: the mean, then the squared deviations
        f"{v}_mu = tl.sum(tl.where(m, {src}, 0.0), axis=1)[:, None] / H",
        f"{v}_d = tl.where(m, ({src}) - {v}_mu, 0.0)",
        f"{v} = tl.sum({v}_d * {v}_d, axis=1)[:, None] / (H - {corr!r})",
    ]
    if name == "std":
        lines.append(f"{v} = tl.sqrt_rn({v})")
    return lines


# the jitted helper the ``tanh`` form calls, at the head of every generated kernel module
TANH_JIT = [
    "@triton.jit",
    "def _tanh(x):",
    "    # tanh from exp: 1 - 2 / (exp(2x) + 1), exact at both saturations",
    "    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)",
]


def stored(n: Node, val: str) -> str:
    """The value ``val`` of node ``n`` as stored: rounded to its bf16 / fp16 dtype, as is for fp32."""
    dt = node_dtype(n)
    return f"_cast_out({val}, {LOW[dt]})" if dt in LOW else val


def render_fused(region: Region, knobs: dict[str, Any], doc: str) -> str:
    """A candidate module part computing ``region``: ``run(*inputs)`` returns its outputs in
    ``region.outputs`` order, or None for inputs the kernel does not serve (the caller then runs the region's
    own ops)."""
    from kernelarc.families import _mem_common as mc

    w = _Writer(region)
    for i, a in enumerate(region.inputs):
        w.load(i, a)
    for j, n in enumerate(region.nodes):
        w.node(j, n)
    idx = {n: j for j, n in enumerate(region.nodes)}
    stores: list[str] = []
    for n in region.outputs:
        j = idx[n]
        role = region.roles[n]
        expr = stored(n, w.names[n])
        if role is Role.full:
            w.param(f"o{j}")
            stores.append(f"tl.store(o{j} + rows64 * H + cols64, {expr}, mask=m)")
        elif role in (Role.row, Role.rowflat):
            w.param(f"o{j}")
            stores.append(f"tl.store(o{j} + rows64, {expr}, mask=rm2)")
    kernel_params = ", ".join([*w.params, "R", "H", "TILE_R: tl.constexpr", "BLOCK_H: tl.constexpr"])
    ind = "        "
    kernel = [
        *TANH_JIT,
        "",
        "",
        "@triton.jit",
        f"def _fused_kernel({kernel_params}):",
        "    pid = tl.program_id(0)",
        "    step = tl.num_programs(0) * TILE_R",
        "    cols = tl.arange(0, BLOCK_H)",
        "    cm2 = (cols < H)[None, :]",
        "    cols64 = cols.to(tl.int64)[None, :]",
        *["    " + ln for ln in w.hoisted],
        *["    " + ln for ln in w.acc_init],
        "    for r0 in range(pid * TILE_R, R, step):",
        "        rows = r0 + tl.arange(0, TILE_R)",
        "        rm2 = (rows < R)[:, None]",
        "        rows64 = rows.to(tl.int64)[:, None]",
        "        m = rm2 & cm2",
        *[ind + ln for ln in w.body],
        *[ind + ln for ln in stores],
        *["    " + ln for ln in w.after],
    ]
    run = _run_source(region, w, idx)
    head = mc.header(FAMILY, f"{doc}: a fused region ({region.describe()})", knobs)
    consts = "\n".join(f"{k} = {knobs[k]!r}" for k in ("TILE", "NUM_WARPS", "WAVES"))
    return head + "\n" + consts + "\n\n\n" + "\n".join(kernel) + "\n\n\n" + run


def _shape_expr(n: Node, role: Role, rank: int) -> str:
    """The output shape of a column or full reduction ``n`` in terms of the anchor ``a`` (a tuple at run time)."""
    keep = _dims(n, rank)[1]
    if role is Role.allred:
        return f"({', '.join(['1'] * rank)},)" if keep and rank else "()"
    return f"({'1, ' * (rank - 1)}a[-1])" if keep else "(a[-1],)"


def _run_source(region: Region, w: _Writer, idx: dict[Node, int]) -> str:
    rank = region.rank
    ins = [f"i{i}" for i in range(len(region.inputs))]
    lines = [f"def run({', '.join(ins)}):"]
    body = [
        f"a = tuple(torch.broadcast_shapes({', '.join(f'{x}.shape' for x in ins)}))",
        "R = torch.Size(a[:-1]).numel()",
        f"if len(a) != {rank} or not 1 <= a[-1] <= {MAX_H} or R == 0:",
        "    return None",
        "H = a[-1]",
        f"dev = {ins[0]}.device",
    ]
    for i, a in enumerate(region.inputs):
        x = f"i{i}"
        # per role: the shape check (else the region's own ops run) and the kernel's view of the input
        bad, view = {
            Role.full: (f"tuple({x}.shape) != a", "(R, H)"),
            Role.row: (f"tuple({x}.shape)[-1:] != (1,) or {x}.numel() != R or {x}.dim() > {rank}", "(R)"),
            Role.col: (f"{x}.numel() != H or {x}.dim() > {rank} or ({x}.dim() and {x}.shape[-1] != H)", "(H)"),
        }.get(region.roles[a], (f"{x}.numel() != 1 or {x}.dim() > {rank}", "(())"))
        body += [f"if {bad}:", "    return None", f"v{i} = {x}.reshape{view}"]
    body += [
        "BLOCK_H = triton.next_power_of_2(H)",
        "TILE_R = max(1, min(TILE // BLOCK_H, triton.next_power_of_2(R)))",
        # 'auto' warps: at most 16 elements of a row block per thread up to 16384 (the start's former 4 warps on 4096
        # elements held 32 each: 167-255 registers on L1/013, L1/087, L2/001 and L2/055 at sm_90a, and L2/001 spilled)
        "E = TILE_R * BLOCK_H",
        f"W = NUM_WARPS if NUM_WARPS != 'auto' else {AUTO_WARPS_EXPR}",
        # one program per block of rows; with column or full sums, at most WAVES per SM, each walking blocks and
        # keeping one partial (their count is what the sums after the kernel read)
        "P = triton.cdiv(R, TILE_R)"
        if not w.after
        else "P = max(1, min(triton.cdiv(R, TILE_R), _num_sms(dev) * WAVES))",
    ]
    outs: dict[Node, str] = {}
    for n in region.outputs:
        j = idx[n]
        role = region.roles[n]
        dt = node_dtype(n)
        if role is Role.full:
            body.append(f"o{j} = torch.empty(a, dtype={dt}, device=dev)")
            outs[n] = f"o{j}"
        elif role is Role.row:
            body.append(f"o{j} = torch.empty((*a[:-1], 1), dtype={dt}, device=dev)")
            outs[n] = f"o{j}"
        elif role is Role.rowflat:
            body.append(f"o{j} = torch.empty(tuple(a[:-1]), dtype={dt}, device=dev)")
            outs[n] = f"o{j}"
    for j, allred in w.partials.items():
        body.append(f"q{j} = torch.empty({'(P,)' if allred else '(P, BLOCK_H)'}, dtype=torch.float32, device=dev)")
    body.append(f"_fused_kernel[(P,)]({', '.join(w.args)}, R, H, TILE_R=TILE_R, BLOCK_H=BLOCK_H, num_warps=W)")
    for n in region.outputs:
        j = idx[n]
        role = region.roles[n]
        if role in (Role.colred, Role.allred):
            name = op(n)
            red = {"amax": "amax", "amin": "amin"}.get(name, "sum")
            q = f"q{j}[:, :H]"
            if role is Role.allred:
                expr = f"q{j}.{red}()"
                count = "(R * H)"
            else:
                expr = f"{q}.{red}(0)"
                count = "R"
            if name == "mean":
                expr = f"({expr} / {count})"
            body.append(f"o{j} = {expr}.reshape({_shape_expr(n, role, rank)}).to({node_dtype(n)})")
            outs[n] = f"o{j}"
    body.append(f"return ({', '.join(outs[n] for n in region.outputs)},)")
    return "\n".join(lines + ["    " + ln for ln in body]) + "\n"
