"""Expert loops: a mixture-of-experts layer written as a Python loop over experts, run as one pass over
every routed token with grouped GEMMs.

The common way to write a sparse MoE layer (Hugging Face's Mixtral / Qwen-MoE blocks, and SOL-ExecBench's
references after them) is

    for e in range(num_experts):
        idx, tok = torch.where(expert_mask[e])          # or torch.where(topk_ids == e)
        if tok.numel() == 0: continue
        x = hidden[tok]                                  # the expert's tokens
        y = down(act(x @ W_gate[e].t()) * (x @ W_up[e].t()))
        out.index_add_(0, tok, y * weights[tok, idx, None])

Capture refuses it (``torch.where`` has a data-dependent size, and the ``if`` branches on it), so without
this module such a problem gets no kernel, and its reference pays one host synchronisation and a dozen
small launches per expert. Here the reference is *run* (not traced symbolically) under a dispatch
recorder on small inputs, and recognised by structure only (no names):

    prefix ops, then E blocks (one per expert, each starting at the expert's mask: ``select(M, 0, e)`` or
    ``eq(X, offset + e)``, then ops on the mask, its ``nonzero``), then suffix ops

where every block that routes a token repeats one template op for op, with the expert id (``e`` or
``offset + e``) as its only integers that differ, and an expert with no token stops at its branch (a host
read of the mask, or its ``nonzero``). The template is then written for all experts at once:

* the masks of all experts stacked (``M`` itself, or ``X == arange(E)``) and one ``nonzero``: its first
  column is each routed row's expert, in expert order, the rest is what the per-expert ``nonzero`` gave,
  concatenated, so every per-row op (gathers, pointwise ops, casts, per-row reductions and views) runs once
  on all rows;
* ``mm(rows, f(W[e]))`` becomes a grouped GEMM over the expert segments (``gemm`` knob): KernelArc's Triton
  kernel (``triton``: one program per row tile of one expert and column tile, the expert found by a binary
  search over the tiles' per-expert offsets, computed on the device with no host read; fp32 rows times 16-bit
  experts upcast by the reference read as the 16-bit rows they were cast from, or split into two bf16 parts),
  ``torch._grouped_mm`` on bf16 operands in the layout it takes (``grouped``), or one ``mm`` per routed
  expert into the output's segment after one host read of the per-expert counts (``loop``, and the fallback);
* ``index_add_(acc, 0, rows, values)`` becomes one ``index_add_`` of all rows, in the same expert order;
* an op of the block that reads nothing of the block (a loop invariant) runs once, before the loop's rows.

The prefix and suffix run as the reference's own aten calls, so routing (softmax, top-k, their casts) is
exactly the reference's. Integers in them are written as the inputs' sizes they equal: the recording is
made at two small shapes (every axis of the definition scaled down, differently) and an integer that
changes between them must equal one input size, or the product of two, in both. The written module is then
checked against the reference on a third shape; any difference, op or pattern outside the above, and the
problem is not recognised (``MoEError`` says why).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from kernelarc.dispatch import CompositionError as DispatchCompositionError
from kernelarc.dispatch import rename_part
from kernelarc.families._mem_common import CAST_OUT
from kernelarc.graph.compose import CompositionError, _fmt, drop_main_guard

log = logging.getLogger(__name__)

aten = torch.ops.aten

GEMMS = ("grouped", "triton", "loop")
# the Triton grouped GEMM's tile knobs and their start
TILE_KNOBS = {"BLOCK_M": (32, 64, 128), "BLOCK_N": (64, 128, 256), "BLOCK_K": (32, 64), "num_warps": (4, 8),
              "num_stages": (2, 3, 4)}  # fmt: skip
TILE_START = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
MIN_EXPERTS = 2


class MoEError(CompositionError):
    """The reference is not an expert loop this module writes (the message says why)."""


class _FewRouted(MoEError):
    """A recording in which fewer than two experts routed a row (more tokens may route more)."""


# ------------------------------------------------------------------------------------------
# recording


@dataclass(frozen=True)
class V:
    """A tensor value of a recording, by number (inputs first)."""

    i: int


@dataclass
class Call:
    target: Any  # an aten OpOverload
    args: tuple
    kwargs: dict
    out: Any  # V, a tuple / list of V, or a Python value


@dataclass
class Recording:
    calls: list[Call]
    inputs: list[Any]  # V for a tensor input, the value otherwise
    meta: dict[int, tuple[tuple[int, ...], torch.dtype]]  # V.i -> (shape, dtype)
    result: Any  # the reference's return value, tensors as V


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ids: dict[int, V] = {}
        self.keep: list[torch.Tensor] = []  # holds every recorded tensor, so no id() is reused
        self.meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self.calls: list[Call] = []

    def ref(self, t: torch.Tensor) -> V:
        v = self.ids.get(id(t))
        if v is None:
            v = self.ids[id(t)] = V(len(self.keep))
            self.keep.append(t)
            self.meta[v.i] = (tuple(t.shape), t.dtype)
        return v

    def name(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            v = self.ids.get(id(x))
            if v is None:
                raise MoEError(f"an op read a tensor the recording never saw ({tuple(x.shape)}, {x.dtype})")
            return v
        return x

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        a, k = tree_map(self.name, args), tree_map(self.name, kwargs)
        self.calls.append(Call(func, a, k, tree_map(lambda o: self.ref(o) if isinstance(o, torch.Tensor) else o, out)))
        return out


def record(fn: Callable, args: Sequence[Any]) -> Recording:
    rec = _Recorder()
    inputs = [rec.ref(a) if isinstance(a, torch.Tensor) else a for a in args]
    with torch.no_grad(), rec:
        result = fn(*args)
    return Recording(rec.calls, inputs, rec.meta, tree_map(rec.name, result))


# ------------------------------------------------------------------------------------------
# the loop's structure


def _refs(x: Any) -> list[V]:
    return [a for a in tree_flatten(x)[0] if isinstance(a, V)]


def _outs(c: Call) -> list[V]:
    return _refs(c.out)


def _is(c: Call, *ops) -> bool:
    return any(c.target is o for o in ops)


@dataclass
class Loop:
    """Where the blocks are in a recording."""

    E: int
    starts: list[int]  # call index of each expert's block start
    style: str  # "select": select(M, 0, e); "eq": eq(X, e)
    source: V  # M or X
    ends: list[int] = field(default_factory=list)  # one past each block's last call
    template: int = -1  # the expert whose block is the template (the first that routes a row)
    offset: int = 0  # the id of the first expert (``ids == offset + e``)


def _expert_index(c: Call) -> tuple[str, V, int] | None:
    """(style, source, e) when ``c`` picks expert ``e`` of a tensor: ``select(M, 0, e)`` or ``eq(X, e)``."""
    if _is(c, aten.select.int) and c.args[1] == 0 and isinstance(c.args[2], int) and isinstance(c.args[0], V):
        return "select", c.args[0], c.args[2]
    if _is(c, aten.eq.Scalar) and isinstance(c.args[1], int) and not isinstance(c.args[1], bool):
        return "eq", c.args[0], c.args[1]
    return None


def find_loop(r: Recording) -> Loop:
    """The blocks' starts: of the tensors whose experts 0..E-1 are each picked once, in order (``_expert_index``),
    the one picked first. Expert-stacked weights qualify too where every expert routes a row; the masks come
    first in each block."""
    groups: dict[tuple[str, int], list[tuple[int, int]]] = {}
    for i, c in enumerate(r.calls):
        if (hit := _expert_index(c)) is not None:
            groups.setdefault((hit[0], hit[1].i), []).append((i, hit[2]))
    # experts c..c+E-1 in order: c = 0 for a mask's leading axis, any offset for ``ids == c + e`` (a rank's local
    # experts among the global ids)
    loops = [(hits[0][0], key, hits) for key, hits in groups.items()
             if len(hits) >= MIN_EXPERTS and [e - hits[0][1] for _i, e in hits] == list(range(len(hits)))
             and (key[0] == "eq" or hits[0][1] == 0)]  # fmt: skip
    if not loops:
        raise MoEError("no loop over experts: no tensor has its experts picked once each, in order")
    _first, (style, source), hits = min(loops)
    loop = Loop(len(hits), [i for i, _e in hits], style, V(source), offset=hits[0][1])
    if style == "select" and r.meta[source][0][0] != loop.E:
        raise MoEError(f"the loop visits {loop.E} experts of a tensor with {r.meta[source][0][0]}")
    if not any(_is(c, aten.nonzero.default) for c in r.calls[loop.starts[0] :]):
        raise MoEError("no loop over experts: the per-expert picks feed no nonzero")
    return loop


def _norm(x: Any, local: dict[int, tuple[int, int]]) -> Any:
    """An argument with a block's own values written by position (call offset, output index)."""
    return tree_map(lambda a: ("blk", *local[a.i]) if isinstance(a, V) and a.i in local else a, x)


def _ints_match(x: Any, y: Any, ex: int, ey: int, offset: int) -> bool:
    """Two blocks' arguments alike, an integer either equal in both or each block's expert id (``e``, or
    ``offset + e`` of an ``ids == offset + e`` loop) in its own."""
    if isinstance(x, list | tuple):
        return isinstance(y, list | tuple) and len(x) == len(y) and all(
            _ints_match(a, b, ex, ey, offset) for a, b in zip(x, y, strict=True))  # fmt: skip
    if isinstance(x, dict):
        return isinstance(y, dict) and x.keys() == y.keys() and all(_ints_match(x[k], y[k], ex, ey, offset) for k in x)
    if isinstance(x, int) and not isinstance(x, bool) and isinstance(y, int) and not isinstance(y, bool):
        return x == y or (x - ex == y - ey and x - ex in (0, offset))
    return type(x) is type(y) and x == y


def _same_block(calls: list[Call], lo: int, e: int, lo2: int, e2: int, n: int, offset: int) -> bool:
    """Whether the ``n`` calls from ``lo`` (expert ``e``'s) and from ``lo2`` (expert ``e2``'s) are one template: the
    same ops, the block's own values by position, the same outer values and constants but for the expert ids."""
    if lo + n > len(calls) or lo2 + n > len(calls):
        return False
    local: dict[int, tuple[int, int]] = {}
    local2: dict[int, tuple[int, int]] = {}
    for j in range(n):
        c, c2 = calls[lo + j], calls[lo2 + j]
        if c.target is not c2.target:
            return False
        if not _ints_match(_norm((c.args, c.kwargs), local), _norm((c2.args, c2.kwargs), local2), e, e2, offset):
            return False
        for k, (v, v2) in enumerate(zip(_outs(c), _outs(c2), strict=False)):
            local[v.i], local2[v2.i] = (j, k), (j, k)
    return True


def _head_len(block: list[Call]) -> int:
    """How many of a block's calls an expert with no row runs: up to the branch that skips it (a host read of the
    mask, ``if not mask.any()``), or else up to its nonzero and the views of it (``if tok.numel() == 0``)."""
    for j, c in enumerate(block):
        if _is(c, aten._local_scalar_dense.default):
            return j + 1
    j = next((j for j, c in enumerate(block) if _is(c, aten.nonzero.default)), len(block) - 1) + 1
    made = {v.i for v in _outs(block[j - 1])}
    while j < len(block) and _packet(block[j]) in ("unbind", "squeeze", "select", "unsqueeze", "t", "transpose"):
        if not any(v.i in made for v in _refs(block[j].args)):
            break
        made.update(v.i for v in _outs(block[j]))
        j += 1
    return j


def split_blocks(r: Recording, loop: Loop) -> None:
    """Each block's end, the template, and that every routing block repeats it (in place)."""
    calls = r.calls
    acc_calls = [j for j in range(loop.starts[0], len(calls)) if _is(calls[j], aten.index_add_.default)]
    if not acc_calls:
        raise MoEError("the expert loop accumulates with no index_add_")
    lengths = [loop.starts[k + 1] - loop.starts[k] for k in range(loop.E - 1)]
    full = max(lengths)
    ends = [s + n for s, n in zip(loop.starts, lengths, strict=False)]
    first = loop.starts[lengths.index(full)]
    last = loop.starts[-1]
    # the last expert's block: as long as the template if it repeats it, else as long as an expert's with no row
    k0, off = lengths.index(full), loop.offset
    if _same_block(calls, first, k0, last, loop.E - 1, full, off):
        ends.append(last + full)
    else:
        empty = [n for n in lengths if n < full]
        ends.append(last + (empty[0] if empty else _head_len(calls[first : first + full])))
    loop.ends = ends
    routed = [k for k in range(loop.E) if ends[k] - loop.starts[k] == full]
    if len(routed) < 2:
        # with one routed block, an index equal to its expert's by chance could not be told from the expert's
        raise _FewRouted("fewer than two experts routed a row in the recording")
    t = loop.template = routed[0]
    if not _is(calls[ends[t] - 1], aten.index_add_.default):
        raise MoEError(f"a routing block ends with {calls[ends[t] - 1].target}, not index_add_")
    for k in routed[1:]:
        if not _same_block(calls, loop.starts[t], t, loop.starts[k], k, full, off):
            raise MoEError(f"expert {k}'s block is not expert {t}'s with the expert index changed")
    short = min(e - s for s, e in zip(loop.starts, ends, strict=True))
    for k in range(loop.E):
        head = ends[k] - loop.starts[k] == short and _same_block(
            calls, loop.starts[t], t, loop.starts[k], k, short, off
        )
        if k not in routed and not head:
            raise MoEError(f"expert {k} routes no row and its block is not the others' head")


# ------------------------------------------------------------------------------------------
# integers as sizes


def _size_exprs(r: Recording) -> list[tuple[str, int]]:
    dims = []
    for pos, v in enumerate(r.inputs):
        if isinstance(v, V):
            for d, n in enumerate(r.meta[v.i][0]):
                dims.append((f"_a{pos}.shape[{d}]", n))
    out = list(dims)
    for i, (ea, na) in enumerate(dims):
        for eb, nb in dims[i:]:
            out.append((f"{ea} * {eb}", na * nb))
    return out


class Ints:
    """Writes an integer of the recording at shape A with its value at shape B: a literal where both agree,
    else the first input size (or product of two) equal to it in both."""

    def __init__(self, a: Recording, b: Recording):
        self.a, self.b = _size_exprs(a), _size_exprs(b)

    def write(self, x: int, y: int) -> str:
        if x == y:
            return repr(x)
        for (ea, na), (_eb, nb) in zip(self.a, self.b, strict=True):
            if na == x and nb == y:
                return ea
        raise MoEError(f"an integer is {x} at one shape and {y} at another, and no input size is")


# ------------------------------------------------------------------------------------------
# writing the module


def _var(v: V) -> str:
    return f"v{v.i}"


class _Writer:
    def __init__(self, ints: Ints):
        self.ints = ints
        self.lines: list[str] = []
        self.names: dict[int, str] = {}

    def name(self, v: V) -> str:
        try:
            return self.names[v.i]
        except KeyError:
            raise MoEError(f"value {v.i} is read before the written module computes it") from None

    def arg(self, a: Any, b: Any) -> str:
        if isinstance(a, V):
            return self.name(a)
        if isinstance(a, list | tuple):
            if not isinstance(b, list | tuple) or len(a) != len(b):
                raise MoEError("the two recordings differ in an argument's structure")
            inner = ", ".join(self.arg(x, y) for x, y in zip(a, b, strict=True))
            return f"[{inner}]" if isinstance(a, list) else (f"({inner},)" if len(a) == 1 else f"({inner})")
        if isinstance(a, int) and not isinstance(a, bool):
            return self.ints.write(a, b)
        try:
            return _fmt(a, self.name)  # the other constants as the composition writes them
        except CompositionError as e:
            raise MoEError(str(e)) from None

    def call(self, target: Any, args: str, out: Any) -> None:
        ns, packet, overload = target.namespace, target.overloadpacket.__name__, target._overloadname
        if any(t in packet for t in _CPU_OPS):
            # recorded on the CPU: the CPU's own form of an op (SDPA's ``..._for_cpu``), which a GPU does not have
            raise MoEError(f"{target} is the CPU's own form of an op")
        expr = f"torch.ops.{ns}.{packet}.{overload}({args})"
        outs = tree_flatten(out)[0]
        fresh = [o for o in outs if isinstance(o, V) and o.i not in self.names]
        if isinstance(out, V):
            if fresh:
                self.names[out.i] = _var(out)
                self.lines.append(f"{_var(out)} = {expr}")
            else:
                self.lines.append(expr)
            return
        if isinstance(out, tuple | list) and out and all(isinstance(o, V) for o in out):
            for o in out:
                self.names.setdefault(o.i, _var(o))
            self.lines.append(", ".join(self.names[o.i] for o in out) + f"{',' if len(out) == 1 else ''} = {expr}")
            return
        self.lines.append(expr)

    def verbatim(self, ca: Call, cb: Call) -> None:
        if ca.target is not cb.target:
            raise MoEError(f"the two recordings differ: {ca.target} against {cb.target}")
        if _is(ca, aten._local_scalar_dense.default):
            # a host read of a tensor's value: where it is a truth value the same at both shapes (a branch the
            # reference took), the module takes that branch only while the value holds, and runs the reference else
            if not isinstance(ca.out, bool) or ca.out != cb.out:
                raise MoEError("a host read of a tensor's value that is not one branch's truth value")
            self.lines.append(
                f"if bool(torch.ops.aten._local_scalar_dense.default({self.name(ca.args[0])})) is not {ca.out!r}:"
            )
            self.lines.append("    return _ref_run(*_args)")
            return
        parts = [self.arg(x, y) for x, y in zip(ca.args, cb.args, strict=True)]
        parts += [f"{k}={self.arg(v, cb.kwargs[k])}" for k, v in ca.kwargs.items()]
        self.call(ca.target, ", ".join(parts), ca.out)


# ops of a block that act on each routed row on its own (the row axis, dim 0, untouched)
_UNARY_ROW = {"_to_copy", "clone", "contiguous", "detach", "alias", "silu", "gelu", "relu", "sigmoid", "tanh",
              "exp", "neg", "abs", "sqrt", "rsqrt", "reciprocal", "square", "erf", "log", "sin", "cos"}  # fmt: skip
_VIEW_EXPERT = {"t", "transpose", "permute", "_to_copy", "clone", "contiguous", "detach", "alias", "unsqueeze"}
_REDUCE_ROW = {"sum", "mean", "amax", "amin"}
# ops on the expert's mask with an axis argument (second), shifted by one on the stacked masks
_MASK_AXIS_OPS = {"any", "all", "sum", "amax", "amin", "unsqueeze", "squeeze", "select", "slice"}


def _shifted(d: Any) -> Any:
    """An axis (or axes) of a per-expert value as the axis of the experts' stacked value (one more leading axis)."""
    if isinstance(d, list | tuple):
        return [_shifted(x) for x in d]
    return d + 1 if d >= 0 else d


def _packet(c: Call) -> str:
    return c.target.overloadpacket.__name__


def _pointwise(c: Call) -> bool:
    return torch.Tag.pointwise in getattr(c.target, "tags", ())


@dataclass
class _Expert:
    base: V  # the expert-stacked tensor
    chain: list[Call]  # ops applied to base[e], in order


class _Block:
    """Writes the template block for all experts at once."""

    def __init__(self, w: _Writer, ra: Recording, rb: Recording, la: Loop, lb: Loop, gemm: str):
        self.w, self.ra, self.rb, self.la, self.lb, self.gemm = w, ra, rb, la, lb, gemm
        self.rows: set[int] = set()  # V.i of row values (dim 0: the routed rows)
        self.experts: dict[int, _Expert] = {}
        self.block: set[int] = set()
        self.acc: V | None = None  # the buffer the block's last call (its index_add_) accumulates into
        self.at = -1  # the recording's index of the template call being written
        self.producer: dict[int, Call] = {}  # V.i -> the block call that made it
        self.masks: set[int] = set()  # V.i of the expert's mask and values computed from it before its nonzero
        self.nz_mask: V | None = None  # the mask the nonzero reads
        self.checks: set[int] = set()  # V.i of whole-mask reductions the branch on an empty expert reads
        self.acc_family: set[int] = set()  # V.i of the accumulator and its views
        self.ungrouped = False  # a GEMM torch._grouped_mm does not take: fp32 products, experts not in bf16

    def kind(self, a: Any) -> str:
        refs = _refs(a)
        if any(v.i in self.rows for v in refs):
            return "row"
        if any(v.i in self.experts for v in refs):
            return "expert"
        return "outer"

    def write(self) -> None:
        la, lb = self.la, self.lb
        ka = la.template
        kb = lb.template
        ca_all = self.ra.calls[la.starts[ka] : la.ends[ka]]
        cb_all = self.rb.calls[lb.starts[kb] : lb.ends[kb]]
        w = self.w
        E = w.ints.write(la.E, lb.E)
        if la.offset != lb.offset:
            raise MoEError("the first expert's id differs between the two recordings")
        w.lines.append(f"_E = {E}")
        src = w.name(la.source)
        if la.style == "select":
            w.lines.append(f"_mask = {src}")
        else:
            shape = f"(-1, *([1] * {src}.dim()))"
            ids = f"torch.arange({la.offset}, {la.offset} + _E, device={src}.device)"
            w.lines.append(f"_mask = {src}.unsqueeze(0) == {ids}.view{shape}")
        for c in ca_all:
            self.block.update(v.i for v in _outs(c))
        # the accumulator (the last call's buffer) and its views: read by nothing of the block but its index_add_
        last = ca_all[-1]
        if not _is(last, aten.index_add_.default) or not isinstance(last.args[0], V):
            raise MoEError("the block does not end with an index_add_")
        self.acc = last.args[0]
        self.acc_family = _aliases(self.ra, self.acc)
        for c in ca_all[:-1]:
            if any(v.i in self.acc_family for v in _refs((c.args, c.kwargs))):
                raise MoEError(f"the block reads its accumulator ({c.target})")
        # the head: the expert's mask, ops on it (stacked: one more leading axis), its nonzero
        w.names[ca_all[0].out.i] = "_mask"
        self.masks.add(ca_all[0].out.i)
        j = 1
        while j < len(ca_all) and not _is(ca_all[j], aten.nonzero.default):
            self.mask_op(ca_all[j], cb_all[j])
            j += 1
        if j == len(ca_all) or ca_all[j].args[0].i not in self.masks:
            raise MoEError("the block's nonzero is not of its expert's mask")
        nz = ca_all[j]
        self.nz_mask = nz.args[0]
        w.lines += [
            f"_nz = torch.ops.aten.nonzero.default({w.name(nz.args[0])})",
            "_eid = _nz[:, 0]",
            "_counts = torch.bincount(_eid, minlength=_E)",
            "_seg = _Segments(_counts)",
            f"{_var(nz.out)} = _nz[:, 1:]",
        ]
        w.names[nz.out.i] = _var(nz.out)
        self.rows.add(nz.out.i)
        for at, (ca, cb) in enumerate(zip(ca_all[j + 1 :], cb_all[j + 1 :], strict=True), la.starts[ka] + j + 1):
            self.at = at
            self.op(ca, cb)
            for v in _outs(ca):
                self.producer[v.i] = ca

    def mask_op(self, ca: Call, cb: Call) -> None:
        """An op between the expert's mask and its nonzero, written on the stacked masks (axes one further)."""
        w = self.w
        reads = [v for v in _refs((ca.args, ca.kwargs)) if v.i in self.masks]
        if _is(ca, aten._local_scalar_dense.default) and ca.args[0].i in self.checks:
            return  # the branch that skips an expert with no row: all experts run at once, an empty one adds nothing
        if not reads:
            if any(v.i in self.block for v in _refs(ca.args)):
                raise MoEError(f"{ca.target} before the block's nonzero")
            w.verbatim(ca, cb)  # a loop invariant
            return
        p = _packet(ca)
        if p in ("any", "all") and len(ca.args) == 1 and not ca.kwargs:
            self.checks.update(v.i for v in _outs(ca))  # a whole-mask reduction, for that branch only: not written
            return
        if _pointwise(ca) or p in ("_to_copy", "clone", "contiguous", "detach", "alias"):
            w.verbatim(ca, cb)
        elif p in _MASK_AXIS_OPS and len(ca.args) >= 2:
            rest = [w.arg(x, y) for x, y in zip(ca.args[2:], cb.args[2:], strict=True)]
            kw = [f"{k}={w.arg(v, cb.kwargs[k])}" for k, v in ca.kwargs.items()]
            w.call(ca.target, ", ".join([w.name(reads[0]), repr(_shifted(ca.args[1])), *rest, *kw]), ca.out)
        else:
            raise MoEError(f"{ca.target} on the expert's mask")
        self.masks.update(v.i for v in _outs(ca))

    def op(self, ca: Call, cb: Call) -> None:
        w = self.w
        p = _packet(ca)
        k = self.kind((ca.args, ca.kwargs))
        if k == "outer" and any(v.i in self.masks or v.i in self.checks for v in _refs((ca.args, ca.kwargs))):
            self.mask_op(ca, cb)  # more of the expert's dense mask, after its nonzero
            return
        e = self.la.template
        if _is(ca, aten.select.int) and ca.args[1] == 0 and ca.args[2] == e and k == "outer":
            base = ca.args[0]
            if base.i in self.block:
                raise MoEError("an expert-stacked tensor the block itself computes")
            self.experts[ca.out.i] = _Expert(base, [])
            return
        if k == "outer":
            if ca.target._schema.is_mutable:
                raise MoEError(f"{ca.target} writes an outer tensor once per expert")
            if self._e_dependent(ca):  # e, or offset + e of a rank's local experts: not a loop invariant
                raise MoEError(f"{ca.target} depends on the expert index in a way not written")
            w.verbatim(ca, cb)  # a loop invariant: once
            return
        if k == "expert":
            if self._e_dependent(ca):
                raise MoEError(f"{ca.target} on an expert's tensor takes the expert id")
            src = next(v for v in _refs(ca.args) if v.i in self.experts)
            if p not in _VIEW_EXPERT or len(_refs(ca.args)) != 1:
                raise MoEError(f"{ca.target} on an expert's tensor")
            ex = self.experts[src.i]
            self.experts[ca.out.i] = _Expert(ex.base, [*ex.chain, ca])
            return
        # row values
        if _is(ca, aten.index_add_.default):
            acc, dim, idx, val = ca.args[:4]
            if len(ca.args) > 4 or set(ca.kwargs) - {"alpha"} or ca.kwargs.get("alpha", 1) != 1:
                raise MoEError("index_add_ with a scale")
            if dim != 0 or acc.i in self.rows or idx.i not in self.rows or val.i not in self.rows:
                raise MoEError("index_add_ of the block not onto an outer tensor's rows")
            if acc != self.acc:
                raise MoEError("the block accumulates into two tensors")
            w.lines.append(f"{w.name(acc)}.index_add_(0, {w.name(idx)}, {w.name(val)})")
            return
        if _is(ca, aten.select.int) and ca.args[0].i in self.rows and ca.args[2] == e + self.la.offset:
            # a routed row's column of its own expert (``w_tok[:, ge]``): a gather per row
            x, dim = ca.args[0], ca.args[1]
            if len(self.ra.meta[x.i][0]) != 2 or dim not in (1, -1) or not self._expert_column():
                raise MoEError(f"{ca.target} of a routed row by the expert id, not its column")
            idx = f"(_eid + {self.la.offset}).unsqueeze(1)"
            w.lines.append(f"{_var(ca.out)} = {w.name(x)}.gather(1, {idx}).squeeze(1)")
            w.names[ca.out.i] = _var(ca.out)
            self.rows.add(ca.out.i)
            return
        if _is(ca, aten.index_select.default):
            base, dim, idx = ca.args
            if dim != 0 or base.i in self.rows or base.i in self.block or idx.i not in self.rows:
                raise MoEError("an index_select of the block that is not a gather of outer rows by routed rows")
            w.call(ca.target, f"{w.name(base)}, 0, {w.name(idx)}", ca.out)
            self.rows.add(ca.out.i)
            return
        if _is(ca, aten.mm.default):
            a, b = ca.args
            if a.i not in self.rows or b.i not in self.experts:
                raise MoEError("a matmul of the block that is not rows times an expert's matrix")
            self._gemm(ca.out, a, self.experts[b.i])
            return
        if _is(ca, aten.unbind.int):
            if ca.args[1] not in (1, -1) or len(self.ra.meta[ca.args[0].i][0]) != 2:
                raise MoEError("unbind of a row value along an axis other than its columns")
            w.call(ca.target, f"{w.name(ca.args[0])}, 1", ca.out)
            self.rows.update(v.i for v in _outs(ca))
            return
        if _is(ca, aten.index.Tensor) and len(ca.args[1]) == 1 and ca.args[1][0] == self.nz_mask:
            # outer[mask]: the mask's true positions in row-major order, the nonzero's rows
            base = ca.args[0]
            if base.i in self.block:
                raise MoEError("a boolean gather of a value of the block")
            w.call(ca.target, f"{w.name(base)}, list(_nz[:, 1:].unbind(1))", ca.out)
            self.rows.add(ca.out.i)
            return
        if _is(ca, aten.index.Tensor):
            base, idx = ca.args
            if base.i in self.rows or any(i is None or i.i not in self.rows for i in idx):
                raise MoEError("an index of the block that is not a gather of outer rows by routed rows")
            inner = ", ".join("None" if i is None else w.name(i) for i in idx)
            if base.i in self.masks:  # a value of the expert's mask, stacked: each row reads its expert's
                if any(i is None for i in idx):
                    raise MoEError("a partial index of a value of the expert's mask")
                inner = f"_eid, {inner}"
            elif base.i in self.experts:
                raise MoEError("an index of an expert's tensor by routed rows")
            w.call(ca.target, f"{w.name(base)}, [{inner}]", ca.out)
            self.rows.add(ca.out.i)
            return
        if self._e_dependent(ca):
            raise MoEError(f"{ca.target} takes the expert id")
        if _pointwise(ca) or p in _UNARY_ROW:
            self._pointwise(ca, cb)
            return
        if p in ("unsqueeze", "squeeze", "select", "slice", "view", "reshape", "_unsafe_view", "expand"):
            self._row_view(ca, cb)
            return
        if p in _REDUCE_ROW and len(ca.args) > 1:
            x = ca.args[0]
            rank = len(self.ra.meta[x.i][0])
            dims = ca.args[1] if isinstance(ca.args[1], list | tuple) else [ca.args[1]]
            if x.i not in self.rows or not dims or None in dims or any(d % rank == 0 for d in dims):
                raise MoEError(f"{ca.target} over the routed rows")
            w.verbatim(ca, cb)
            self.rows.add(ca.out.i)
            return
        raise MoEError(f"{ca.target} in the expert block is not written")

    def _twin(self) -> tuple[int, Call] | None:
        """The call being written as another routing block makes it: (that block's expert, its call); None
        where no other block routes a row."""
        la = self.la
        full = la.ends[la.template] - la.starts[la.template]
        other = [k for k in range(la.E) if k != la.template and la.ends[k] - la.starts[k] == full]
        if not other:
            return None
        return other[0], self.ra.calls[self.at - la.starts[la.template] + la.starts[other[0]]]

    def _expert_column(self) -> bool:
        """Whether the same select in another routing block takes that block's expert id."""
        twin = self._twin()
        return twin is not None and twin[1].args[2] == twin[0] + self.la.offset

    def _e_dependent(self, ca: Call) -> bool:
        """Whether an op of the template block takes other integers in another routing block."""
        twin = self._twin()
        if twin is None:
            return True
        ints = [x for x in tree_flatten(ca.args)[0] if isinstance(x, int)]
        return ints != [x for x in tree_flatten(twin[1].args)[0] if isinstance(x, int)]

    def _pointwise(self, ca: Call, cb: Call) -> None:
        w = self.w
        subst: dict[int, str] = {}
        for v in _refs((ca.args, ca.kwargs)):
            if v.i in self.experts:
                # an expert's own vector (a bias): each row reads its expert's
                ex = self.experts[v.i]
                if any(_packet(c) != "_to_copy" for c in ex.chain):
                    raise MoEError("a pointwise op on a reshaped expert tensor")
                expr = f"{w.name(ex.base)}[_eid]"
                for c in ex.chain:
                    expr = f"{expr}.to({c.kwargs.get('dtype')})"
                # [rows, *its shape], with 1s between so that it broadcasts as it did against the block's rows
                eshape = self.ra.meta[v.i][0]
                pad = len(self.ra.meta[ca.out.i][0]) - 1 - len(eshape) if isinstance(ca.out, V) else -1
                if pad < 0:
                    raise MoEError("an expert's tensor of more axes than the rows it meets")
                dims = ", ".join(["-1", *["1"] * pad, f"*{w.name(ex.base)}.shape[1:]"])
                subst[v.i] = f"({expr}).view({dims})"
        saved = dict(w.names)
        for i, s in subst.items():
            w.names[i] = s
        try:
            w.verbatim(ca, cb)
        finally:
            for i in subst:
                if i in saved:
                    w.names[i] = saved[i]
                else:
                    w.names.pop(i, None)
        self.rows.update(v.i for v in _outs(ca))

    def _row_view(self, ca: Call, cb: Call) -> None:
        w = self.w
        x = ca.args[0]
        if x.i not in self.rows:
            raise MoEError(f"{ca.target} of an outer value inside the block")
        p = _packet(ca)
        rank = len(self.ra.meta[x.i][0])
        if p in ("view", "reshape", "_unsafe_view", "expand"):
            size = list(ca.args[1])
            n = self.ra.meta[x.i][0][0]
            if not size or size[0] != n:
                raise MoEError(f"{ca.target} that moves the routed rows")
            rest = [w.arg(a, b) for a, b in zip(size[1:], list(cb.args[1])[1:], strict=True)]
            w.call(ca.target, f"{w.name(x)}, [-1, {', '.join(rest)}]", ca.out)
        else:
            dim = ca.args[1] if len(ca.args) > 1 else None
            whole = (
                p == "slice"
                and dim == 0
                and list(ca.args[2:]) in ([], [0], [None, None], [0, 2**63 - 1], [0, 2**63 - 1, 1])
            )
            on_rows = (p == "unsqueeze" and dim % (rank + 1) == 0) or (p != "unsqueeze" and dim % rank == 0)
            if dim is None or (on_rows and not whole):
                raise MoEError(f"{ca.target} on the routed rows' axis")
            w.verbatim(ca, cb)
        self.rows.add(ca.out.i)

    def _gemm(self, out: V, a: V, ex: _Expert) -> None:
        w = self.w
        # the expert's matrix for expert e, and the stacked [E, K, N] view of the expert-stacked tensor (its views
        # only: a cast of the chain is applied per expert, or by the kernel)
        expr = f"{w.name(ex.base)}[e]"
        stacked = w.name(ex.base)
        shape, dtype = self.ra.meta[ex.base.i]
        if len(shape) != 3:
            raise MoEError("an expert matrix that is not a slice of a 3-d tensor")
        cast = None
        for c in ex.chain:
            p = _packet(c)
            if p == "t":
                expr, stacked = f"{expr}.t()", f"{stacked}.transpose(-2, -1)"
            elif p == "transpose":
                d0, d1 = c.args[1], c.args[2]
                expr = f"{expr}.transpose({d0}, {d1})"
                stacked = f"{stacked}.transpose({_shifted(d0)}, {_shifted(d1)})"
            elif p == "_to_copy" and set(c.kwargs) <= {"dtype"}:
                expr = f"{expr}.to({c.kwargs['dtype']})"
                # an exact upcast of 16-bit weights is what the kernel does in registers; any other cast is the loop's
                exact = cast is None and dtype in (torch.bfloat16, torch.float16) and c.kwargs["dtype"] == torch.float32
                cast = "torch.float32" if exact else "False"
            elif p in ("contiguous", "clone", "detach", "alias"):
                expr = f"{expr}.contiguous()"
            else:
                raise MoEError(f"{c.target} on an expert's matrix before its matmul")
        # rows that are the fp32 upcast of 16-bit rows: the kernel reads the 16-bit ones (the products are exact)
        src = self.producer.get(a.i)
        a16 = "None"
        if src is not None and _packet(src) == "_to_copy" and src.kwargs.get("dtype") == torch.float32:
            x = src.args[0]
            if isinstance(x, V) and x.i in self.rows and self.ra.meta[x.i][1] in (torch.bfloat16, torch.float16):
                a16 = w.name(x)
        self.ungrouped = self.ungrouped or cast is not None or dtype != torch.bfloat16
        w.lines.append(
            f"{_var(out)} = _seg.mm({w.name(a)}, lambda e: {expr}, {stacked}, cast={cast or 'None'}, a16={a16})"
        )
        w.names[out.i] = _var(out)
        self.rows.add(out.i)


_RUNTIME = '''
class _Segments:
    """The routed rows in expert order: per-expert counts, their offsets, and GEMMs over the segments."""

    def __init__(self, counts):
        self.counts_dev = counts
        self._host = None
        self._offs = None
        self._tiles = {}

    def host(self):
        if self._host is None:
            self._host = self.counts_dev.tolist()  # one host read per call, where the reference had one per expert
        return self._host

    def offs(self):
        if self._offs is None:
            self._offs = torch.cumsum(self.counts_dev, 0, dtype=torch.int32)
        return self._offs

    def tiles(self, bm):
        """Each expert's first row and first row tile of ``bm`` rows (E + 1 entries each), on the device."""
        if bm not in self._tiles:
            c = self.counts_dev.to(torch.int32)
            seg = torch.zeros(c.numel() + 1, dtype=torch.int32, device=c.device)
            first = torch.zeros_like(seg)
            seg[1:] = torch.cumsum(c, 0)
            first[1:] = torch.cumsum((c + bm - 1) // bm, 0)
            self._tiles[bm] = (seg, first)
        return self._tiles[bm]

    def mm(self, a, w_of, stacked, cast=None, a16=None):
        """rows @ w_of(e) for each expert's segment of rows; ``cast``: the dtype the expert matrices are upcast to
        (False: a cast the kernels do not do), ``a16``: the 16-bit rows ``a`` is the exact upcast of."""
        if GEMM == "grouped" and cast is None and _grouped_ok(a, stacked):
            return torch._grouped_mm(a.contiguous(), stacked, offs=self.offs())
        if GEMM == "triton" and cast is not False and _triton_ok(a, stacked, cast):
            if a16 is not None and a16.dtype == stacked.dtype:
                return self.triton(a16, stacked, a.dtype, split=False)
            # fp32 rows in two parts of the experts' dtype: bf16 only (fp16's range would overflow or flush them)
            if a.dtype != torch.float32 or stacked.dtype == torch.bfloat16:
                return self.triton(a, stacked, a.dtype, split=a.dtype == torch.float32)
        first = w_of(0)
        out = torch.empty((a.shape[0], first.shape[-1]), dtype=torch.result_type(a, first), device=a.device)
        lo = 0
        for e, n in enumerate(self.host()):
            if n:
                torch.mm(a[lo : lo + n], w_of(e), out=out[lo : lo + n])
                lo += n
        return out

    def triton(self, a, b, out_dtype, split):
        m, k = a.shape
        n_exp, _k, n = b.shape
        seg, first = self.tiles(BLOCK_M)
        c = torch.empty((m, n), dtype=out_dtype, device=a.device)
        grid = (triton.cdiv(m, BLOCK_M) + n_exp, triton.cdiv(n, BLOCK_N))
        _gmm_kernel[grid](
            a, b, c, seg, first, n_exp, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2),
            c.stride(0), c.stride(1), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, SPLIT=split,
            LOG_E=max(1, n_exp.bit_length()), UPCAST=INTERPRET, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
        )
        return c


def _grouped_ok(a, b):
    """torch._grouped_mm's own constraints: bf16 operands (its CUDA kernel's only 16-bit type), b a transposed
    matrix (a Linear weight's layout), rows of whole 16 bytes (TMA; a stride that is not gives wrong results, not an
    error, in the versions without the check), on a GPU from Hopper on (elsewhere one mm per expert)."""
    if a.dtype != torch.bfloat16 or b.dtype != a.dtype or a.dim() != 2 or b.dim() != 3:
        return False
    if a.shape[0] == 0 or a.shape[1] % 8 or b.shape[-1] % 8 or b.stride(-2) != 1:
        return False
    if a.is_cuda:
        return torch.cuda.get_device_capability(a.device) >= (9, 0)
    return True


def _triton_ok(a, b, cast):
    """The kernel's cases: 16-bit experts times rows of their dtype, or (``cast`` fp32) times fp32 rows; on a GPU
    or under Triton's interpreter."""
    if b.dtype not in (torch.bfloat16, torch.float16) or a.dim() != 2 or b.dim() != 3 or a.shape[0] == 0:
        return False
    if not (a.dtype == b.dtype if cast is None else a.dtype == torch.float32):
        return False
    return a.is_cuda or INTERPRET


@triton.jit
def _gmm_kernel(a_ptr, b_ptr, c_ptr, seg_ptr, first_ptr, E, N, K, s_am, s_ak, s_be, s_bk, s_bn, s_cm, s_cn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
                LOG_E: tl.constexpr, UPCAST: tl.constexpr):
    # one program per (row tile of one expert, column tile): row tiles never straddle two experts
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    if t >= tl.load(first_ptr + E):
        return
    lo = t * 0
    hi = lo + E
    for _ in range(LOG_E):  # the last expert whose first tile is at or before t: the one t belongs to
        mid = (lo + hi) // 2
        ok = tl.load(first_ptr + mid) <= t
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid)
    e = lo
    row0 = tl.load(seg_ptr + e) + (t - tl.load(first_ptr + e)) * BLOCK_M
    row_end = tl.load(seg_ptr + e + 1)
    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mm = rm < row_end
    mn = rn < N
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + e.to(tl.int64) * s_be + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        km = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=mm[:, None] & km[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=km[:, None] & mn[None, :], other=0.0)
        if SPLIT:
            # fp32 rows as two bf16 parts (the experts are exact in bf16): products to about 2^-16 on tensor cores
            hi16 = a.to(b.dtype)
            lo16 = (a - hi16.to(tl.float32)).to(b.dtype)
            if UPCAST:
                acc += tl.dot(hi16.to(tl.float32), b.to(tl.float32))
                acc += tl.dot(lo16.to(tl.float32), b.to(tl.float32))
            else:
                acc = tl.dot(hi16, b, acc)
                acc = tl.dot(lo16, b, acc)
        elif UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    c_ptrs = c_ptr + rm.to(tl.int64)[:, None] * s_cm + rn[None, :] * s_cn
    tl.store(c_ptrs, _cast_out(acc, c_ptr.dtype.element_ty), mask=mm[:, None] & mn[None, :])
'''


_CPU_OPS = ("cpu", "mkldnn", "mkl_", "onednn")

_ALIASING = {"detach", "alias", "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "unsqueeze", "squeeze",
             "select", "slice", "expand", "as_strided", "view_as", "flatten", "unflatten", "contiguous"}  # fmt: skip


def _aliases(r: Recording, v: V) -> set[int]:
    """``v`` and every value of the recording that may share its storage: views of it, what it is a view of, and
    so on (by the ops that can return a view)."""
    edges: dict[int, set[int]] = {}
    for c in r.calls:
        if _packet(c) in _ALIASING and isinstance(c.args[0], V):
            for o in _outs(c):
                edges.setdefault(c.args[0].i, set()).add(o.i)
                edges.setdefault(o.i, set()).add(c.args[0].i)
    seen, todo = {v.i}, [v.i]
    while todo:
        for n in edges.get(todo.pop(), ()):
            if n not in seen:
                seen.add(n)
                todo.append(n)
    return seen


def _range_check(calls: Sequence[Call], j: int) -> tuple[list[int], list[Any]] | None:
    """``one_hot``'s range check of its indices starting at call ``j``, as torch writes it: ``aminmax`` and the two
    host reads of its results (torch 2.13), or ``min``, a read, ``max``, a read (torch 2.11): the positions of its
    calls and the values it reads (the minimum and maximum); None where ``j`` does not start one."""
    read = aten._local_scalar_dense.default
    c = calls[j]
    found = None
    if _is(c, aten.aminmax.default) and j + 2 < len(calls):
        lo, hi = _outs(c)
        reads = calls[j + 1 : j + 3]
        if all(_is(x, read) for x in reads) and [x.args[0] for x in reads] == [lo, hi]:
            found = [j, j + 1, j + 2], [lo, hi]
    if _is(c, aten.min.default) and j + 3 < len(calls):
        lo_read, mx, hi_read = calls[j + 1 : j + 4]
        if _is(lo_read, read) and _is(mx, aten.max.default) and _is(hi_read, read) and mx.args[0] == c.args[0]:
            lo, hi = _outs(c)[0], _outs(mx)[0]
            if [lo_read.args[0], hi_read.args[0]] == [lo, hi]:
                found = [j, j + 1, j + 2, j + 3], [lo, hi]
    if found is None:
        return None
    # then one_hot's body: the zeros it fills, a scatter_ of ones into them (not a size or a branch read off them)
    after = calls[found[0][-1] + 1 : found[0][-1] + 5]
    body = bool(after) and _is(after[0], aten.zeros.default) and any(_is(x, aten.scatter_.value) for x in after)
    return found if body else None


def _host_checks(r: Recording) -> set[int]:
    """Calls of a recording the written module leaves out: ``one_hot``'s range check of its indices (``_range_check``),
    which only raises on indices out of range, each read a host synchronisation. Other host reads of a tensor's value
    are not left out (``_Writer.verbatim`` guards them)."""
    dead: set[int] = set()
    for j in range(len(r.calls)):
        found = _range_check(r.calls, j)
        if found is None:
            continue
        at, values = found
        others = [k for k, x in enumerate(r.calls) if k not in at[1:] and any(v in values for v in _refs(x.args))]
        if not others:
            dead.update(at)
    return dead


def write_module(title: str, ra: Recording, rb: Recording, la: Loop, lb: Loop, knobs: dict[str, Any], reference: str
                 ) -> str:  # fmt: skip
    """The candidate's source: prefix verbatim, the block once for all experts, suffix verbatim; the reference
    embedded as ``_ref_run`` for the inputs the module was not written for."""
    return _write(title, ra, rb, la, lb, knobs, reference)[0]


def _write(title: str, ra: Recording, rb: Recording, la: Loop, lb: Loop, knobs: dict[str, Any], reference: str
           ) -> tuple[str, bool]:  # fmt: skip
    """The module's source, and whether a GEMM of it is one torch._grouped_mm does not take (``_Block.ungrouped``)."""
    if len(ra.calls) - la.ends[-1] != len(rb.calls) - lb.ends[-1] or la.starts[0] != lb.starts[0]:
        raise MoEError("the prefix or suffix differs between the two recordings")
    w = _Writer(Ints(ra, rb))
    for pos, v in enumerate(ra.inputs):
        if isinstance(v, V):
            w.names[v.i] = f"_a{pos}"
    dead = _host_checks(ra)
    for j, (ca, cb) in enumerate(zip(ra.calls[: la.starts[0]], rb.calls[: lb.starts[0]], strict=True)):
        if j not in dead:
            w.verbatim(ca, cb)
    block = _Block(w, ra, rb, la, lb, knobs["gemm"])
    block.write()
    for j, (ca, cb) in enumerate(zip(ra.calls[la.ends[-1] :], rb.calls[lb.ends[-1] :], strict=True), la.ends[-1]):
        if j not in dead:
            w.verbatim(ca, cb)
    ret = w.arg(ra.result, rb.result)
    n = len(ra.inputs)
    params = ", ".join(f"_a{i}" for i in range(n))
    tensors = [f"_a{i}" for i, v in enumerate(ra.inputs) if isinstance(v, V)]
    # the scalar inputs as recorded (a flag that steers the reference's Python, as L2/008's norm_topk_prob): the
    # module is written for those values, and runs the reference for any others
    scalars = [(i, v) for i, v in enumerate(ra.inputs) if not isinstance(v, V)]
    guards = [f"_a{i} != {_fmt(v, str)}" for i, v in scalars if isinstance(v, bool | int | float | str) or v is None]
    if len(guards) != len(scalars):
        raise MoEError("a scalar input of a type the module cannot compare")
    head = [f"if {' or '.join(guards)}:", "    return _ref_run(*_args)"] if guards else []
    unpack = f"{params}{',' if n == 1 else ''} = _args"
    body = "\n".join("    " + ln for ln in [unpack, *head, f"_dev = {tensors[0]}.device", *w.lines])
    try:
        ref = rename_part(drop_main_guard(reference), "_ref_")
    except DispatchCompositionError as e:
        raise MoEError(f"the reference cannot be embedded: {e}") from e
    bound = {"math", "os", "torch", "triton", "tl"}
    imports = []
    for text, names in ref.imports:
        if any(nm in bound for nm in names) and text not in ("import math", "import os", "import torch"):
            raise MoEError(f"the reference binds a name the module uses: {text}")
        if text not in ("import math", "import os", "import torch"):
            imports.append(text)
    knob_doc = "\n".join(f"    {k} = {v!r}" for k, v in sorted(knobs.items()))
    extra_imports = "\n".join(imports)
    return (
        f'''"""KernelArc candidate: {title}'s expert loop written once for all experts (kernelarc.graph.moe).

Knobs:
{knob_doc}
"""

import math
import os

import torch
import triton
import triton.language as tl
{extra_imports}

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
GEMM = {knobs["gemm"]!r}
BLOCK_M = {knobs["BLOCK_M"]}
BLOCK_N = {knobs["BLOCK_N"]}
BLOCK_K = {knobs["BLOCK_K"]}
NUM_WARPS = {knobs["num_warps"]}
NUM_STAGES = {knobs["num_stages"]}
{CAST_OUT}
{_RUNTIME}

# ---- part _ref_ (the reference, for the inputs the module was not written for)

{ref.body}


@torch.no_grad()
def run(*_args):
{body}
    return {ret}
''',
        block.ungrouped,
    )


# ------------------------------------------------------------------------------------------
# shapes to record at, and recognition


def _scaled(v: int, div: int, floor: int) -> int:
    return v if v < 32 else max(floor, v // div)


def _distinct(values: dict[str, int]) -> dict[str, int]:
    """``values`` with no two axes equal (a later one raised by 8, or by 1 under 16): an integer of a recording
    then names one axis, not whichever of two equal ones comes first."""
    used: set[int] = set()
    out = {}
    for name, v in values.items():
        while v in used:
            v += 8 if v >= 16 else 1
        used.add(v)
        out[name] = v
    return out


def _small_task(task, div: int, floor: int, var_mult: int, var_scale: int = 1):
    """The task at small sizes: every const axis of 32 or more divided by ``div`` (at least ``floor``), the var
    axes of its smallest workload the same way (those under 32 multiplied by ``var_mult``), no two equal; one
    workload."""
    from kernelarc.tasks.loader import Task, resolve_axes
    from kernelarc.tasks.schema import AxisConst

    defn = task.definition
    if not task.workloads:
        raise MoEError("no workload")
    idx = min(range(len(task.workloads)), key=task.io_bytes)
    wl = task.workloads[idx]
    if any(d.type == "safetensors" for d in wl.inputs.values()):
        raise MoEError("safetensors inputs have fixed shapes")
    wanted = {}
    for name, ax in defn.axes.items():
        if isinstance(ax, AxisConst):
            wanted[name] = _scaled(ax.value, div, floor)
        elif name in wl.axes:
            v = wl.axes[name]
            wanted[name] = (_scaled(v, div, floor) if v >= 32 else v * var_mult) * var_scale
    wanted = _distinct(wanted)
    axes = {n: (ax.model_copy(update={"value": wanted[n]}) if isinstance(ax, AxisConst) else ax)
            for n, ax in defn.axes.items()}  # fmt: skip
    small_defn = defn.model_copy(update={"axes": axes})
    given = {k: wanted[k] for k in wl.axes}
    try:
        resolve_axes(small_defn, given)  # constraints
    except Exception as e:  # noqa: BLE001 - the definition's constraints do not hold at small sizes
        raise MoEError(f"the definition's axes do not scale down ({e})") from e
    small_wl = wl.model_copy(update={"axes": given})
    return Task(task.name, task.path, small_defn, [small_wl], task.metadata, [], task.workload_file)


# (div, floor, var_mult) of ``_small_task``: recorded at the first two, checked at the third
SHAPES = ((32, 16, 1), (16, 24, 2), (8, 32, 3))
VAR_SCALES = (1, 4)


@dataclass
class MoE:
    """A recognised expert loop: the two recordings the module is written from."""

    task: str
    ra: Recording
    rb: Recording
    la: Loop
    lb: Loop
    reference: str
    ungrouped: bool = False  # a GEMM torch._grouped_mm does not take (fp32 products, experts not in bf16)

    def describe(self) -> str:
        k = self.la.template
        n = self.la.ends[k] - self.la.starts[k]
        return f"expert loop over {self.la.E} experts ({self.la.style} masks), a {n}-op block"

    def render(self, knobs: dict[str, Any]) -> str:
        return write_module(self.task, self.ra, self.rb, self.la, self.lb, {**TILE_START, **knobs}, self.reference)


def _inputs(task) -> list[Any]:
    from kernelarc.tasks.inputs import make_inputs

    return make_inputs(task, 0, 1, "cpu")


def _close(got: Any, want: Any) -> str | None:
    g, w = tree_flatten(got)[0], tree_flatten(want)[0]
    if len(g) != len(w):
        return f"{len(g)} outputs, the reference gives {len(w)}"
    for k, (x, y) in enumerate(zip(g, w, strict=True)):
        if not isinstance(y, torch.Tensor):
            continue
        if not isinstance(x, torch.Tensor) or x.shape != y.shape or x.dtype != y.dtype:
            return f"output {k}: {getattr(x, 'shape', x)} {getattr(x, 'dtype', '')} against {y.shape} {y.dtype}"
        xd, yd = x.double(), y.double()
        scale = yd.abs().max().item() if y.numel() else 0.0
        tol = (1e-2 if y.dtype in (torch.bfloat16, torch.float16) else 1e-4) * max(scale, 1e-6)
        err = (xd - yd).abs().max().item() if y.numel() else 0.0
        if not err <= tol:
            return f"output {k}: max abs difference {err:.3g} (reference's largest {scale:.3g})"
    return None


def recognise_moe(task) -> MoE:
    """Record the reference at two small shapes, find its expert loop, write it, and check the module against
    the reference at a third shape (``MoEError`` when any step does not hold)."""
    from kernelarc.tasks.inputs import load_module

    source = drop_main_guard(task.definition.reference)
    ref = load_module(source, f"moe_ref_{task.name}")
    # var axes (tokens) four times larger where the small ones leave fewer than two experts routed (a rank's local
    # experts among many)
    for var_scale in VAR_SCALES:
        recs = []
        for div, floor, mult in SHAPES[:2]:
            small = _small_task(task, div, floor, mult, var_scale)
            try:
                args = _inputs(small)
                recs.append(record(ref.run, args))
            except MoEError:
                raise
            except Exception as e:  # noqa: BLE001 - a reference that does not run small is not recognised
                why = f"{type(e).__name__}: {str(e)[:160]}"
                raise MoEError(f"the reference does not run at small sizes ({why})") from e
        ra, rb = recs
        la, lb = find_loop(ra), find_loop(rb)
        try:
            split_blocks(ra, la)
            split_blocks(rb, lb)
            break
        except _FewRouted:
            if var_scale == VAR_SCALES[-1]:
                raise
    moe = MoE(task.name, ra, rb, la, lb, source)
    moe.ungrouped = _write(task.name, ra, rb, la, lb, {**TILE_START, "gemm": "loop"}, source)[1]
    div, floor, mult = SHAPES[2]
    check = _small_task(task, div, floor, mult, var_scale)
    args = _inputs(check)
    want = ref.run(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args])
    for gemm in GEMMS:
        mod = load_module(moe.render({"gemm": gemm}), f"moe_{gemm}_{task.name}")
        try:
            got = mod.run(*args)
        except Exception as e:  # noqa: BLE001
            raise MoEError(f"the written module fails at a third shape ({gemm}: {type(e).__name__}: {e})") from e
        bad = _close(got, want)
        if bad:
            raise MoEError(f"the written module differs from the reference at a third shape ({gemm}): {bad}")
    return moe
