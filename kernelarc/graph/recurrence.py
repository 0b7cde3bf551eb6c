"""Per-step recurrences: a reference that loops over a time axis in Python, as one Triton kernel.

A reference such as RWKV's WKV (``for t in range(T): ... out[:, t] = num / den; state = ...``)
unrolls under tracing into one block of aten ops per step, so ``capture`` refuses it
(``GraphTooLarge``) and the problem would get no kernel at all. Here such a reference is traced
at a few small loop lengths and recognised, by structure only (no names, no shapes), as

    prefix ops, then K = T + dk identical per-step blocks of P ops, then suffix ops

where each argument of a block op is an outer value (a placeholder or prefix op), a value of the
same step, the value of the previous step (a carried state, whose first step reads an outer
value: its initial value), the step index (``k + c`` or ``K - 1 - k + c``), or a constant equal
in every step. The prefix and suffix must not depend on the loop length other than through
integers that equal ``T + c`` (written as such). The block must be pointwise on one lane shape L
(the broadcast of its values' shapes): pointwise aten ops, ``select`` of an outer tensor by the
step index (a per-step load), and ``copy_`` into such a select of a tensor the prefix created
(a per-step store). Loop-invariant ops that are not pointwise (views, reductions of outer
values) run once before the kernel.

The split is the first (smallest prefix) under which the traces of lengths 3 and 4 fit; it is
checked on lengths 5, 2 and 1. A step need not start where the Python loop body does: a loop
whose value of two steps back is only read by ops that can run in the step before is carried
as their results (a first-order recurrence over the rotated step); a value two steps back met
by the step's own values is refused, as are ops that are not pointwise (a matmul on the state),
in-place ops other than the per-step store, stores into inputs, and reads of the tensor stored.

The candidate runs the prefix as plain ``torch.ops.aten`` calls (a zero-filled buffer that the
stores overwrite entirely is allocated unfilled), launches one kernel in which a program owns
BLOCK lanes of L and walks the K steps with the carried state in registers (the per-step loads of
UNROLL steps issued together, the next UNROLL steps' loads issued before this chunk computes with
PREFETCH; a value the step computes twice computed once), stores the last step's values the
suffix reads into fresh tensors, and runs the suffix. Traces are concrete: one case per input
signature with the loop dimension wildcarded; anything else (and loops shorter than the
shortest checked) runs the reference. Under Triton's interpreter one program takes all lanes.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.families._mem_common import CAST_OUT
from kernelarc.graph.capture import MAX_CONCRETE_CASES, CaptureError, example_inputs, node_meta_val, trace
from kernelarc.graph.compose import CompositionError, _callee, _fmt, _namer, _var, drop_main_guard

log = logging.getLogger(__name__)

SMALL = (3, 4, 5)  # loop lengths the structure is read from (first two) and checked on (third)
SHORT = (1, 2)  # shorter loop lengths it is checked on too: the shortest checked is the shortest served
DK = (0, -1, 1)  # steps = T + dk (``range(1, T)``: dk = -1)
KNOB_DEFAULTS = {"BLOCK": 64, "num_warps": 2, "UNROLL": 8, "PREFETCH": True, "precision": "ieee"}


class RecurrenceError(CompositionError):
    """The reference is not a per-step recurrence this module can emit (the message says why)."""


# ------------------------------------------------------------------------------------------
# normalised graphs


@dataclass(frozen=True)
class _R:
    """A graph value in a trace, by position: ``o`` outer (index among the trace's nodes), ``l`` the
    same step's block node, ``p`` the previous step's, ``L`` the last step's (after the loop), ``s`` a
    suffix node (index in the suffix)."""

    kind: str
    i: int


@dataclass(frozen=True)
class Out:
    i: int  # an outer value (placeholder or prefix op): index among the trace's nodes


@dataclass(frozen=True)
class Loc:
    j: int  # block node j of the same step


@dataclass(frozen=True)
class Prev:
    j: int  # block node j of the previous step
    init: int  # the outer value the first step reads instead


@dataclass(frozen=True)
class Step:
    rev: bool  # k + off (forward) or K - 1 - k + off (reverse)
    off: int | float
    scale: int | float = 1  # a number the loop computes from its index (``t * 0.5``): off + scale * k


@dataclass(frozen=True)
class TLen:
    c: int  # the loop axis' length plus c
    fl: bool = False  # as a float (``float(T)``)


def _tlen_src(c: int, fl: bool = False) -> str:
    src = "T" if c == 0 else f"(T + {c})" if c > 0 else f"(T - {-c})"
    return f"float({src})" if fl else src


class _TLenNumber:
    """A number argument of the prefix or suffix that is the loop length plus ``c``: written as such
    (``compose._fmt`` writes numbers with ``repr``). Mixed into ``int`` and ``float`` below."""

    c: int

    def __new__(cls, value: Any, c: int):
        obj = super().__new__(cls, value)
        obj.c = c
        return obj

    def __repr__(self) -> str:
        return _tlen_src(self.c, isinstance(self, float))


class _TInt(_TLenNumber, int):
    pass


class _TFloat(_TLenNumber, float):
    pass


@dataclass(frozen=True)
class _Geo:
    n_ph: int  # placeholders
    s: int  # prefix ops
    P: int  # ops per step
    n_suf: int  # suffix ops (the output node not counted)
    dk: int  # steps = T + dk


def _key(n: Node) -> tuple:
    v = n.meta.get("val")
    kind = str(v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__
    return (n.op, n.target, kind)


def _map(a: Any, f: Callable[[Any], Any]) -> Any:
    if isinstance(a, list | tuple):
        return type(a)(_map(x, f) for x in a)
    if isinstance(a, dict):
        return tuple((k, _map(a[k], f)) for k in sorted(a))
    return f(a)


def _same(x: Any, y: Any) -> bool:
    if isinstance(x, list | tuple) or isinstance(y, list | tuple):
        return type(x) is type(y) and len(x) == len(y) and all(_same(a, b) for a, b in zip(x, y, strict=True))
    if type(x) is not type(y):
        return False
    if isinstance(x, float):  # numbers the loop computes are rebuilt as off + scale * k: equal to rounding
        return (math.isnan(x) and math.isnan(y)) or x == y or math.isclose(x, y, rel_tol=1e-12, abs_tol=1e-15)
    return x == y


@dataclass
class _Raw:
    """A trace cut into prefix, per-step blocks and suffix, with every node argument as an ``_R``."""

    prefix: list[tuple]  # (key, args, kwargs)
    blocks: list[list[tuple]]
    suffix: list[tuple]  # the output node last


def _split(gm: torch.fx.GraphModule, T: int, g: _Geo) -> _Raw:
    ns = [n for n in gm.graph.nodes if n.op != "output"]
    out = next(n for n in gm.graph.nodes if n.op == "output")
    K = T + g.dk
    if len(ns) != g.n_ph + g.s + K * g.P + g.n_suf:
        raise RecurrenceError(f"the trace of length {T} has {len(ns)} nodes, not prefix + {K} steps + suffix")
    if any(n.op != "placeholder" for n in ns[: g.n_ph]) or any(n.op == "placeholder" for n in ns[g.n_ph :]):
        raise RecurrenceError("placeholders are not the graph's first nodes")
    pos = {n: i for i, n in enumerate(ns)}
    start = g.n_ph + g.s
    end = start + K * g.P

    def entry(n: Node, tag: Callable[[Node], _R]) -> tuple:
        if n.op not in ("call_function", "output"):
            raise RecurrenceError(f"unsupported graph node {n.op} {n.target}")
        f = lambda a: tag(a) if isinstance(a, Node) else a  # noqa: E731
        return (_key(n), _map(n.args, f), _map(n.kwargs, f))

    def outer_only(a: Node) -> _R:
        i = pos[a]
        if i >= start:
            raise RecurrenceError("a prefix op reads a later value")
        return _R("o", i)

    blocks: list[list[tuple]] = []
    for k in range(K):

        def in_block(a: Node, k: int = k) -> _R:
            i = pos[a]
            if i < start:
                return _R("o", i)
            kk, j = divmod(i - start, g.P)
            if i < end and kk == k:
                return _R("l", j)
            if i < end and kk == k - 1:
                return _R("p", j)
            raise RecurrenceError(f"step {k} reads a value of step {kk} (only the previous step can be carried)")

        base = start + k * g.P
        blocks.append([entry(n, in_block) for n in ns[base : base + g.P]])

    def in_suffix(a: Node) -> _R:
        i = pos[a]
        if i < start:
            return _R("o", i)
        if i >= end:
            return _R("s", i - end)
        kk, j = divmod(i - start, g.P)
        if kk != K - 1:
            raise RecurrenceError(f"the code after the loop reads a value of step {kk} of {K} (only the last is kept)")
        return _R("L", j)

    prefix = [entry(n, outer_only) for n in ns[g.n_ph : start]]
    suffix = [entry(n, in_suffix) for n in ns[end:]] + [entry(out, in_suffix)]
    return _Raw(prefix, blocks, suffix)


def _merge_steps(vals: list[Any], K: int) -> Any:
    """One template argument from its values in the K steps of one trace."""
    x0 = vals[0]
    if isinstance(x0, list | tuple):
        if not all(type(v) is type(x0) and len(v) == len(x0) for v in vals):
            raise RecurrenceError("an argument list changes from step to step")
        return type(x0)(_merge_steps([v[i] for v in vals], K) for i in range(len(x0)))
    if any(isinstance(v, _R) for v in vals):
        if not all(isinstance(v, _R) for v in vals):
            raise RecurrenceError("an argument is a value in some steps and a constant in others")
        later = set(vals[1:])
        if len(later) != 1:
            raise RecurrenceError("a block argument refers to different values from step to step")
        w = vals[1]
        if w.kind == "p":
            if x0.kind != "o":
                raise RecurrenceError("a carried value's first step reads a value of the same step")
            return Prev(w.i, x0.i)
        if x0 != w:
            raise RecurrenceError("the first step reads another value than the later ones")
        return Out(w.i) if w.kind == "o" else Loc(w.i)
    if all(_same(v, x0) for v in vals):
        return x0
    if all(isinstance(v, int) and not isinstance(v, bool) for v in vals):
        if len({v - k for k, v in enumerate(vals)}) == 1:
            return Step(False, x0)
        if len({v + k for k, v in enumerate(vals)}) == 1:
            return Step(True, x0 - (K - 1))
    if all(isinstance(v, float) for v in vals):
        d = vals[1] - x0
        if d != 0 and all(_same(v, x0 + k * d) for k, v in enumerate(vals)):
            return Step(False, x0, d)
    raise RecurrenceError(f"a constant changes from step to step and is not the step index ({vals[:4]})")


def _merge_traces(x: Any, y: Any, a: int) -> Any:
    """The template of two traces (loop length a and a + 1): equal parts stay, integers one apart are T + c."""
    if isinstance(x, list | tuple):
        if type(y) is not type(x) or len(x) != len(y):
            raise RecurrenceError("the graph's structure changes with the loop length")
        return type(x)(_merge_traces(u, v, a) for u, v in zip(x, y, strict=True))
    if _same(x, y):
        return x
    ints = all(isinstance(v, int) and not isinstance(v, bool) and not isinstance(v, _R) for v in (x, y))
    if ints and y - x == 1:
        return TLen(x - a)
    floats = all(isinstance(v, float) and math.isfinite(v) and v.is_integer() for v in (x, y))
    if floats and y - x == 1.0:
        return TLen(int(x) - a, True)
    raise RecurrenceError(f"a constant depends on the loop length other than as its length ({x!r} vs {y!r})")


def _inst(t: Any, T: int, K: int, k: int | None) -> Any:
    """The raw value of template ``t`` in a trace of length T (K steps), in step ``k`` (None: prefix/suffix)."""
    if isinstance(t, list | tuple):
        return type(t)(_inst(x, T, K, k) for x in t)
    if isinstance(t, TLen):
        return float(T + t.c) if t.fl else T + t.c
    if isinstance(t, Out):
        return _R("o", t.i)
    if isinstance(t, Loc):
        return _R("l", t.j)
    if isinstance(t, Prev):
        return _R("o", t.init) if k == 0 else _R("p", t.j)
    if isinstance(t, Step):
        assert k is not None
        return (K - 1 - k if t.rev else k) * t.scale + t.off
    return t


@dataclass
class _Template:
    geo: _Geo
    a: int
    prefix: list[tuple]
    block: list[tuple]
    suffix: list[tuple]

    def matches(self, raw: _Raw, T: int) -> bool:
        K = T + self.geo.dk
        if not _same(_inst(self.prefix, T, K, None), raw.prefix):
            return False
        if not _same(_inst(self.suffix, T, K, None), raw.suffix):
            return False
        return all(_same(_inst(self.block, T, K, k), blk) for k, blk in enumerate(raw.blocks))


def _block_template(raw: _Raw) -> list[tuple]:
    K = len(raw.blocks)
    out = []
    for j in range(len(raw.blocks[0])):
        keys = {raw.blocks[k][j][0] for k in range(K)}
        if len(keys) != 1:
            raise RecurrenceError("the steps run different ops")
        out.append(_merge_steps([raw.blocks[k][j] for k in range(K)], K))
    return out


def _template(ga: torch.fx.GraphModule, gb: torch.fx.GraphModule, a: int) -> _Template:
    """The smallest prefix (and steps = T + dk) under which the traces of length a and a + 1 are a prefix,
    identical per-step blocks and a suffix."""
    na = [n for n in ga.graph.nodes if n.op != "output"]
    nb = [n for n in gb.graph.nodes if n.op != "output"]
    n_ph = sum(n.op == "placeholder" for n in na)
    P = len(nb) - len(na)
    if P <= 0:
        raise RecurrenceError("the graph does not grow with the loop length")
    ka, kb = [_key(n) for n in na[n_ph:]], [_key(n) for n in nb[n_ph:]]
    why = "no prefix / per-step blocks / suffix split fits the traces"
    for dk in DK:
        K = a + dk
        if K < 2:
            continue
        for s in range(0, len(ka) - K * P + 1):
            suf = len(ka) - s - K * P
            blocks = [kb[s + k * P : s + (k + 1) * P] for k in range(K + 1)]
            if ka[:s] != kb[:s] or ka[len(ka) - suf :] != kb[len(kb) - suf :] or any(b != blocks[0] for b in blocks):
                continue
            if any(ka[s + k * P : s + (k + 1) * P] != blocks[0] for k in range(K)):
                continue
            g = _Geo(n_ph, s, P, suf, dk)
            try:
                ra, rb = _split(ga, a, g), _split(gb, a + 1, g)
                return _Template(
                    g,
                    a,
                    _merge_traces(ra.prefix, rb.prefix, a),
                    _merge_traces(_block_template(ra), _block_template(rb), a),
                    _merge_traces(ra.suffix, rb.suffix, a),
                )
            except RecurrenceError as e:
                why = str(e)
    raise RecurrenceError(why)


# ------------------------------------------------------------------------------------------
# the kernel plan


_TL = {torch.float32: "tl.float32", torch.float16: "tl.float16", torch.bfloat16: "tl.bfloat16",
       torch.float64: "tl.float64", torch.int8: "tl.int8", torch.int16: "tl.int16", torch.int32: "tl.int32",
       torch.int64: "tl.int64", torch.uint8: "tl.uint8", torch.bool: "tl.int1"}  # fmt: skip

# allocations a per-step store may write into (fresh memory the reference owns, never an input)
_FRESH = {"zeros_like", "empty_like", "ones_like", "full_like", "zeros", "empty", "ones", "full", "new_zeros",
          "new_empty", "new_ones", "new_full", "empty_strided", "clone", "_to_copy"}  # fmt: skip
_IDENTITY = {"clone", "alias", "detach", "contiguous", "lift_fresh_copy"}
# views that keep every lane's element where it is under right-aligned broadcasting (checked on the shapes)
_RESHAPE = {"view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "view_as", "expand", "expand_as"}
_CASTS = {"to", "_to_copy", "type_as"}
# a buffer the per-step stores fill completely needs no fill: (allocation without it, position of the fill value)
_UNFILLED = {"zeros_like": ("empty_like.default", None), "ones_like": ("empty_like.default", None),
             "full_like": ("empty_like.default", 1), "zeros": ("empty.memory_format", None),
             "ones": ("empty.memory_format", None), "full": ("empty.memory_format", 1),
             "new_zeros": ("new_empty.default", None), "new_ones": ("new_empty.default", None),
             "new_full": ("new_empty.default", 2)}  # fmt: skip
_MARKERS = (Out, Loc, Prev, Step, TLen)


def _opname(target: Any) -> str | None:
    if isinstance(target, torch._ops.OpOverload) and target.namespace == "aten":
        return target.overloadpacket.__name__
    return None


def _opmath(d: torch.dtype) -> torch.dtype:
    return torch.float32 if d in (torch.float16, torch.bfloat16) else d


@dataclass(frozen=True)
class _Ref:
    """A value in the kernel: ``ptr`` (loaded through pointer i: once, or per step), ``node`` (block value j),
    ``state`` (block node j of the previous step), ``step`` (the step index), ``tlen`` (T + i), ``const``."""

    kind: str
    i: Any = None
    rev: bool = False
    off: int = 0


@dataclass
class _Ptr:
    run: str  # run-side tensor expression (broadcast to the lane shape at the launch)
    dtype: torch.dtype
    shape: tuple[int, ...]
    loop: str | None = None  # run-side stride per step (per-step loads and stores)
    role: str = "in"  # in (loaded before the loop) | step (loaded per step) | store | out (stored after the loop)


@dataclass
class _Item:
    j: int
    kind: str  # value | store
    op: str = ""
    overload: str = ""
    args: tuple = ()  # _Ref per positional argument
    kwargs: dict = field(default_factory=dict)
    metas: tuple = ()  # per positional argument: meta tensor or Python number (type promotion)
    dtype: torch.dtype | None = None
    ptr: int | None = None  # store: the pointer written
    invariant: bool = False  # computed once before the loop


@dataclass
class _Plan:
    L: tuple[int, ...]  # the lane shape
    ptrs: list[_Ptr]
    items: list[_Item]  # in step order
    states: dict[int, tuple[_Ref, int]]  # carried block node j -> (its value in a step, pointer of its initial value)
    exports: dict[int, tuple[_Ref, int]]  # last-step node j the suffix reads -> (its value, output pointer)
    hoisted: list[str]  # run-side lines before the launch (loop-invariant ops that are not pointwise)
    run_names: dict[int, str]  # block node j -> run-side name (hoisted values, exported outputs)
    step_used: bool = False
    unfilled: set[int] = field(default_factory=set)  # outer indices of buffers the stores fill completely

    def item(self, j: int) -> _Item | None:
        return next((it for it in self.items if it.j == j and it.kind == "value"), None)

    def dtype(self, r: _Ref) -> torch.dtype | None:
        if r.kind == "ptr":
            return self.ptrs[r.i].dtype
        if r.kind == "node":
            it = self.item(r.i)
            return it.dtype if it is not None else None
        if r.kind == "state":
            return self.dtype(self.states[r.i][0])
        return None

    def invariant(self, r: _Ref) -> bool:
        if r.kind == "ptr":
            return self.ptrs[r.i].role == "in"
        if r.kind == "node":
            it = self.item(r.i)
            return it is not None and it.invariant
        return r.kind in ("tlen", "const")

    def uses(self, op: str) -> bool:
        return any(it.kind == "value" and it.op == op for it in self.items)


def _shape_of(v: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in v.shape)


def _strip_leading_ones(s: Sequence[int]) -> tuple[int, ...]:
    s = tuple(int(x) for x in s)
    while s and s[0] == 1:
        s = s[1:]
    return s


def _refs(t: Any, kinds: tuple[type, ...]) -> list[Any]:
    found: list[Any] = []
    _map(t, lambda a: found.append(a) if isinstance(a, kinds) else None)
    return found


class _Analysis:
    """Turns the block template of one case into a kernel plan, or refuses."""

    def __init__(self, tpl: _Template, ga: torch.fx.GraphModule, gb: torch.fx.GraphModule):
        self.t = tpl
        self.g = tpl.geo
        self.na = [n for n in ga.graph.nodes if n.op != "output"]
        self.nb = [n for n in gb.graph.nodes if n.op != "output"]
        self.pos = {n: i for i, n in enumerate(self.na)}
        self.start = self.g.n_ph + self.g.s
        self.ka, self.kb = tpl.a + self.g.dk, tpl.a + 1 + self.g.dk
        self.ptrs: list[_Ptr] = []
        self.ptr_of: dict[tuple, int] = {}
        self.node: set[int] = set()  # block nodes computed in the kernel
        # per-step view j -> (outer index, or -1 - j' of a hoisted node j'; its selects)
        self.view: dict[int, tuple[int, tuple]] = {}
        self.hoisted: dict[int, str] = {}
        self.hoisted_lines: list[str] = []
        self.items: list[_Item] = []
        self.prevs: dict[int, int] = {}  # carried block node j -> outer index of its initial value
        self.written: set[int] = set()  # outer values a per-step store writes (and everything derived from them)
        self.store_view: dict[int, int] = {}  # copy_ node j -> the view it writes
        self.same: dict[int, int] = {}  # block node j -> an earlier node computing the same value (CSE)
        self.seen: dict[str, int] = {}

    def metas(self, j: int, which: str = "ab") -> list[Any]:
        out = []
        if "a" in which:
            out += [node_meta_val(self.na[self.start + k * self.g.P + j]) for k in range(self.ka)]
        if "b" in which:
            out += [node_meta_val(self.nb[self.start + k * self.g.P + j]) for k in range(self.kb)]
        return out

    def outer_meta(self, i: int) -> tuple[Any, Any]:
        return node_meta_val(self.na[i]), node_meta_val(self.nb[i])

    def live(self) -> set[int]:
        """Block nodes whose values reach a store, the suffix or an effect (ops that mutate are never dead)."""
        roots: set[int] = set()
        for j, (key, _args, _kwargs) in enumerate(self.t.block):
            target = key[1]
            if _opname(target) is None or target._schema.is_mutable:
                roots.add(j)
        for entry in self.t.suffix:
            roots |= {r.i for r in _refs(entry, (_R,)) if r.kind == "L"}
        live: set[int] = set()
        todo = list(roots)
        while todo:
            j = todo.pop()
            if j not in live:
                live.add(j)
                todo += [r.j for r in _refs(self.t.block[j], (Loc, Prev))]
        return live

    def ptr(self, key: tuple, p: _Ptr) -> int:
        if key not in self.ptr_of:
            self.ptr_of[key] = len(self.ptrs)
            self.ptrs.append(p)
        return self.ptr_of[key]

    def scan_stores(self, live: set[int]) -> None:
        for j in sorted(live):
            key, args, _kwargs = self.t.block[j]
            if _opname(key[1]) != "copy_" or not args:
                continue
            base = args[0]
            while isinstance(base, Loc) and _opname(self.t.block[base.j][0][1]) == "select":
                base = self.t.block[base.j][1][0]
            if isinstance(base, Out):
                self.written |= self.aliases(base.i)

    def aliases(self, i: int) -> set[int]:
        """Outer index i and every prefix op that (transitively) reads it."""
        out = {i}
        for k in range(max(i + 1, self.g.n_ph), self.start):
            if any(self.pos.get(x) in out for x in self.na[k].all_input_nodes):
                out.add(k)
        return out

    def readable(self, i: int) -> None:
        if i in self.written:
            raise RecurrenceError("the loop reads a tensor it also writes per step")

    def outer_ptr(self, i: int) -> _Ref:
        ma, mb = self.outer_meta(i)
        if not isinstance(ma, torch.Tensor) or not isinstance(mb, torch.Tensor):
            raise RecurrenceError("a block op reads an outer value that is not a tensor")
        if _shape_of(ma) != _shape_of(mb):
            raise RecurrenceError("an outer tensor the steps read changes shape with the loop length")
        if ma.dtype not in _TL:
            raise RecurrenceError(f"the steps read a {ma.dtype} tensor")
        self.readable(i)
        return _Ref("ptr", self.ptr(("o", i), _Ptr(_var(self.na[i]), ma.dtype, _shape_of(ma))))

    def ref_of(self, a: Any) -> _Ref:
        """The kernel value of a template argument."""
        if isinstance(a, Out):
            return self.outer_ptr(a.i)
        if isinstance(a, Loc):
            if a.j in self.view:
                return _Ref("ptr", self.view_ptr(a.j, "step"))
            if a.j in self.hoisted:
                m = self.metas(a.j)[0]
                if m.dtype not in _TL:
                    raise RecurrenceError(f"the steps read a {m.dtype} tensor")
                return _Ref("ptr", self.ptr(("h", a.j), _Ptr(self.hoisted[a.j], m.dtype, _shape_of(m))))
            if a.j in self.same:
                return _Ref("node", self.same[a.j])
            if a.j in self.node:
                return _Ref("node", a.j)
            raise RecurrenceError(f"block node {a.j} is read but is no value the kernel computes")
        if isinstance(a, Prev):
            if self.prevs.setdefault(a.j, a.init) != a.init:
                raise RecurrenceError("a carried value starts from two different values")
            return _Ref("state", a.j)
        if isinstance(a, Step):
            return _Ref("step", a.scale, a.rev, a.off)
        if isinstance(a, TLen):
            return _Ref("tlen", a.c, a.fl)
        if isinstance(a, list | tuple):
            raise RecurrenceError("a pointwise op in the loop takes a list")
        return _Ref("const", a)

    def select_view(self, j: int, args: tuple) -> None:
        """``select`` of an outer (or hoisted) tensor by the step index, or of such a view."""
        src, dim, idx = args[0], args[1], args[2]
        if isinstance(src, Loc) and src.j in self.view:
            base, sels = self.view[src.j]
        elif isinstance(src, Out):
            base, sels = src.i, ()
        else:
            base, sels = -1 - src.j, ()
        if not isinstance(dim, int) or isinstance(dim, bool) or isinstance(idx, bool):
            raise RecurrenceError("a select whose dimension is not a constant")
        if not isinstance(idx, int | Step | TLen):
            raise RecurrenceError("a select whose index is neither a constant nor the step index")
        self.view[j] = (base, (*sels, (dim, idx)))

    def view_ptr(self, j: int, role: str) -> int:
        """The pointer of per-step view j: its base selected at the first step's index, moved by the loop stride."""
        base, sels = self.view[j]
        if base >= 0:
            ma, mb = self.outer_meta(base)
            shape_a, shape_b, dtype = _shape_of(ma), _shape_of(mb), ma.dtype
            run = _var(self.na[base])
            if role == "step":
                self.readable(base)
        else:
            m = self.metas(-1 - base)[0]
            shape_a = shape_b = _shape_of(m)
            run, dtype = self.hoisted[-1 - base], m.dtype
        if dtype not in _TL:
            raise RecurrenceError(f"the steps read or write a {dtype} tensor")
        dims = list(range(len(shape_a)))
        expr, loop_terms = run, []
        for dim, idx in sels:
            d = dim + len(dims) if dim < 0 else dim
            if not 0 <= d < len(dims):
                raise RecurrenceError("a select dimension is out of range")
            bd = dims.pop(d)
            if isinstance(idx, Step) and (idx.scale != 1 or not isinstance(idx.off, int)):
                raise RecurrenceError("a select index computed from the step index")
            if isinstance(idx, TLen) and idx.fl:
                raise RecurrenceError("a float select index")
            if isinstance(idx, Step):
                c = shape_a[bd] - self.t.a  # the dimension holds T + c entries; off .. K - 1 + off must fit
                if shape_b[bd] - (self.t.a + 1) != c:
                    raise RecurrenceError("a per-step select indexes a dimension that is not the loop's")
                if idx.off < 0 or self.g.dk + idx.off > c:
                    raise RecurrenceError("the step index runs outside the loop dimension")
                first = f"K - 1 + {idx.off}" if idx.rev else str(idx.off)
                expr = f"{expr}.select({d}, {first})"
                loop_terms.append(f"{'-' if idx.rev else ''}{run}.stride({bd})")
            elif isinstance(idx, TLen):
                expr = f"{expr}.select({d}, {_tlen_src(idx.c)})"
            else:
                if shape_a[bd] != shape_b[bd] or not -shape_a[bd] <= idx < shape_a[bd]:
                    raise RecurrenceError("a constant select index is out of range or on the loop dimension")
                expr = f"{expr}.select({d}, {idx})"
        shape = tuple(shape_a[d] for d in dims)
        if shape != tuple(shape_b[d] for d in dims):
            raise RecurrenceError("a per-step view's shape changes with the loop length")
        loop = " + ".join(loop_terms) if loop_terms else None
        if loop is None and role == "step":
            role = "in"
        return self.ptr(("v", base, sels, role), _Ptr(expr, dtype, shape, loop, role))

    def hoist(self, j: int, target: Any, args: tuple, kwargs: tuple) -> None:
        """A loop-invariant op that is not pointwise: run once before the launch (its value is the same every step)."""
        if torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
            raise RecurrenceError(f"{_opname(target)} in the loop draws random numbers")

        def name(a: Any) -> str:
            if isinstance(a, Out):
                self.readable(a.i)
                return _var(self.na[a.i])
            if isinstance(a, Loc) and a.j in self.hoisted:
                return self.hoisted[a.j]
            raise RecurrenceError("internal: a hoisted op reads a kernel value")

        def src(a: Any) -> str:
            if isinstance(a, Out | Loc):
                return name(a)
            if isinstance(a, TLen):
                return _tlen_src(a.c, a.fl)
            if isinstance(a, list):
                return "[" + ", ".join(src(x) for x in a) + "]"
            if isinstance(a, tuple):
                inner = ", ".join(src(x) for x in a)
                return f"({inner},)" if len(a) == 1 else f"({inner})"
            return _fmt(a, name)

        var = f"h_{j}"
        parts = [src(x) for x in args] + [f"{k}={src(v)}" for k, v in kwargs]
        self.hoisted_lines.append(f"{var} = {_callee(target)}({', '.join(parts)})")
        self.hoisted[j] = var

    def invariant_args(self, entry: tuple) -> bool:
        if _refs(entry, (Prev, Step)):
            return False
        return all(r.j in self.hoisted for r in _refs(entry, (Loc,)))

    def is_invariant(self, r: _Ref) -> bool:
        if r.kind == "ptr":
            return self.ptrs[r.i].role == "in"
        if r.kind == "node":
            return any(it.j == r.i and it.invariant for it in self.items)
        return r.kind in ("tlen", "const")

    def run(self) -> _Plan:
        live = self.live()
        self.scan_stores(live)
        for j, entry in enumerate(self.t.block):
            if j not in live:
                continue
            key, args, kwargs = entry
            target = key[1]
            name = _opname(target)
            if name is None:
                raise RecurrenceError(f"{target} in the loop body is not an aten op")
            if name == "copy_" and len(args) >= 2 and isinstance(args[0], Loc) and args[0].j in self.view:
                self.store(j, args, kwargs)
                continue
            if target._schema.is_mutable:
                raise RecurrenceError(f"the loop mutates a tensor in place ({name}) other than by a per-step store")
            if name == "select" and args:
                src = args[0]
                of_view = isinstance(src, Loc) and src.j in self.view
                of_outer = isinstance(src, Out) or (isinstance(src, Loc) and src.j in self.hoisted)
                if of_view or (of_outer and isinstance(args[2] if len(args) > 2 else None, Step)):
                    self.select_view(j, args)
                    continue
            if not all(isinstance(m, torch.Tensor) for m in self.metas(j)):
                raise RecurrenceError(f"{name} in the loop does not give a tensor")
            if name not in _POINTWISE:
                if self.invariant_args(entry):
                    self.hoist(j, target, args, kwargs)
                    continue
                raise RecurrenceError(f"{name} in the loop body is not pointwise (only elementwise steps are emitted)")
            self.value(j, name, target, args, kwargs)
        return self.finish()

    def value(self, j: int, name: str, target: Any, args: tuple, kwargs: tuple) -> None:
        ms = self.metas(j)
        dtypes = {m.dtype for m in ms}
        if len(dtypes) != 1:
            raise RecurrenceError(f"{name} gives different dtypes in different steps")
        d = ms[0].dtype
        if d not in _TL:
            raise RecurrenceError(f"{name} in the loop gives {d}")
        first_only = name in _RESHAPE or name in _CASTS or name in _IDENTITY
        refs, metas = [], []
        for n, a in enumerate(args):
            if first_only and n > 0:  # sizes, dtypes, the tensor type_as takes its dtype from: not operands
                refs.append(_Ref("const", None))
                metas.append(None)
                continue
            refs.append(self.ref_of(a))
            if isinstance(a, Out):
                metas.append(self.outer_meta(a.i)[0])
            elif isinstance(a, Loc | Prev):
                metas.append(self.metas(a.j)[-1])
            elif isinstance(a, Step | TLen):
                metas.append(0)
            else:
                metas.append(a)
        kw = dict(kwargs)
        for k, v in kw.items():
            if _refs(v, _MARKERS) and not (first_only and k in ("dtype", "memory_format", "other")):
                raise RecurrenceError(f"{name} in the loop: keyword {k} is not a constant")
        if name in _RESHAPE:
            src = metas[0]
            if not isinstance(src, torch.Tensor):
                raise RecurrenceError(f"{name} of a number")
            keeps = name in ("expand", "expand_as") or all(
                _strip_leading_ones(src.shape) == _strip_leading_ones(m.shape) for m in ms
            )
            if not keeps:
                raise RecurrenceError(f"{name} in the loop moves elements between lanes")
        key = repr((name, target._overloadname, refs, sorted(kw.items()), d))
        if key in self.seen:  # the step computes this value already (RWKV: k + u twice)
            self.same[j] = self.seen[key]
            return
        self.seen[key] = j
        item = _Item(j, "value", name, target._overloadname, tuple(refs), kw, tuple(metas), d)
        item.invariant = all(self.is_invariant(r) for r in refs)
        self.items.append(item)
        self.node.add(j)

    def store(self, j: int, args: tuple, kwargs: tuple) -> None:
        dst, src = args[0], args[1]
        if any(v not in (False, None) for _k, v in kwargs) or len(args) > 2 and args[2] not in (False, None):
            raise RecurrenceError("copy_ with non_blocking")
        base, _sels = self.view[dst.j]
        n = self.na[base] if base >= 0 else None
        if n is None or base < self.g.n_ph or n.op != "call_function" or _opname(n.target) not in _FRESH:
            raise RecurrenceError("the loop writes into a tensor the reference did not create before the loop "
                                  "(an input, or a view of one)")  # fmt: skip
        p = self.view_ptr(dst.j, "store")
        if isinstance(src, TLen | list | tuple):
            raise RecurrenceError("a per-step store of the loop length or a list")
        r = self.ref_of(src)
        self.items.append(_Item(j, "store", args=(r,), ptr=p, dtype=self.ptrs[p].dtype))
        self.store_view[j] = dst.j
        readers = [r for r in _refs(self.t.block, (Loc, Prev)) if r.j == j]
        readers += [r for r in _refs(self.t.suffix, (_R,)) if r.kind == "L" and r.i == j]
        if readers:
            raise RecurrenceError("the result of a per-step store is read")

    def lane_shape(self, which: str) -> tuple[int, ...]:
        shapes = [p.shape for p in self.ptrs]
        for it in self.items:
            if it.kind == "value":
                shapes += [_shape_of(m) for m in self.metas(it.j, which)]
        try:
            return tuple(int(s) for s in torch.broadcast_shapes(*shapes)) if shapes else ()
        except RuntimeError as e:
            raise RecurrenceError(f"the step's values do not broadcast to one lane shape: {e}") from e

    def finish(self) -> _Plan:
        states: dict[int, tuple[_Ref, int]] = {}
        for j, init in self.prevs.items():
            val = self.ref_of(Loc(j))
            ip = self.outer_ptr(init).i
            have = self.ptrs[val.i].dtype if val.kind == "ptr" else next(it.dtype for it in self.items if it.j == val.i)
            if have != self.ptrs[ip].dtype:
                raise RecurrenceError(f"a carried value is {have} but starts as {self.ptrs[ip].dtype}")
            states[j] = (val, ip)
        lasts = sorted({r.i for r in _refs(self.t.suffix, (_R,)) if r.kind == "L"})
        exports: dict[int, tuple[_Ref, int]] = {}
        pending: list[tuple[int, _Ref, tuple, torch.dtype]] = []
        for j in lasts:
            if j in self.hoisted:
                continue
            val = self.ref_of(Loc(j))
            ms = self.metas(j)
            shapes = {_shape_of(m) for m in ms}
            if len(shapes) != 1:
                raise RecurrenceError("a value the code after the loop reads changes shape from step to step")
            pending.append((j, val, shapes.pop(), ms[0].dtype))
        L = self.lane_shape("a")
        if self.lane_shape("b") != L:
            raise RecurrenceError("the per-step values' shape changes with the loop length")
        for it in self.items:
            if it.kind == "store" and self.ptrs[it.ptr].shape != L:
                raise RecurrenceError("a per-step store does not write one element per lane")
        run_names = dict(self.hoisted)
        for j, val, shape, dt in pending:
            exports[j] = (val, len(self.ptrs))
            self.ptrs.append(_Ptr(f"r_{j}", dt, shape, None, "out"))
            run_names[j] = f"r_{j}"
        step_used = any(r.kind == "step" for it in self.items for r in it.args)
        return _Plan(L, self.ptrs, self.items, states, exports, self.hoisted_lines, run_names, step_used,
                     self.unfilled())  # fmt: skip

    def unfilled(self) -> set[int]:
        """Buffers created with a fill that one per-step store overwrites entirely (every lane, every index of
        the loop dimension) before anything reads them: allocated without the fill."""
        by_base: dict[int, list[tuple]] = {}
        for v in self.store_view.values():
            base, sels = self.view[v]
            by_base.setdefault(base, []).append(sels)
        out = set()
        for base, views in by_base.items():
            n = self.na[base]
            if len(views) != 1 or len(views[0]) != 1 or _opname(n.target) not in _UNFILLED:
                continue
            dim, idx = views[0][0]
            if not isinstance(idx, Step) or idx.off != 0:
                continue
            shape = _shape_of(node_meta_val(n))
            d = dim + len(shape) if dim < 0 else dim
            if shape[d] - self.t.a != self.g.dk:  # the K steps are every index of the dimension
                continue
            if any(self.pos.get(u, self.start) < self.start for u in n.users):  # read before the loop
                continue
            out.add(base)
        return out


# ------------------------------------------------------------------------------------------
# pointwise ops -> Triton expressions


@dataclass
class _Ctx:
    """An op's operands as Triton expressions, for its handler."""

    exprs: list[str]
    kinds: list[str]  # tensor | const | step | tlen
    dtypes: list[torch.dtype | None]
    consts: list[Any]
    metas: tuple
    kwargs: dict
    out: torch.dtype
    precise: bool
    overload: str

    def const(self, i: int, default: Any = None) -> Any:
        return self.consts[i] if i < len(self.kinds) and self.kinds[i] == "const" else default

    def is_const(self, i: int) -> bool:
        return i < len(self.kinds) and self.kinds[i] == "const"


def _lit(v: Any, c: torch.dtype) -> str:
    if not isinstance(v, bool | int | float):
        raise RecurrenceError(f"constant {v!r} is not a number")
    if c == torch.bool:
        return "True" if bool(v) else "False"
    if c.is_floating_point:
        f = float(v)
        if math.isnan(f):
            return "_NAN"
        if math.isinf(f):
            return "_INF" if f > 0 else "(-_INF)"
        return f"tl.full([], {f!r}, tl.float64)" if c == torch.float64 else repr(f)
    return repr(int(v))


def _as(x: _Ctx, i: int, c: torch.dtype) -> str:
    """Operand i in dtype c."""
    kind, e = x.kinds[i], x.exprs[i]
    if kind == "const":
        return _lit(x.consts[i], c)
    if kind == "step":
        return f"{e}.to({_TL[c]})"
    if kind == "tlen":
        return e
    return _cast_expr(e, x.dtypes[i], c)


def _promoted(x: _Ctx) -> torch.dtype:
    try:
        return torch.result_type(x.metas[0], x.metas[1])
    except Exception as e:  # noqa: BLE001 - metas the promotion rules do not take
        raise RecurrenceError(f"cannot promote the operands' dtypes: {e}") from e


def _nanprop(c: torch.dtype) -> str:
    return ", propagate_nan=tl.PropagateNan.ALL" if c.is_floating_point else ""


def _div(a: str, b: str, x: _Ctx, c: torch.dtype) -> str:
    return f"tl.math.div_rn({a}, {b})" if x.precise and c == torch.float32 else f"({a} / {b})"


def _h_arith(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    c = _opmath(x.out)
    if c == torch.bool:
        raise RecurrenceError(f"{name} of booleans")
    a, b = _as(x, 0, c), _as(x, 1, c)
    if name in ("add", "sub", "rsub"):
        alpha = x.const(2, x.kwargs.get("alpha", 1))
        if len(x.kinds) > 2 and not x.is_const(2):
            raise RecurrenceError(f"{name} with a tensor alpha")
        sa, sb = (f"({_lit(alpha, c)} * {a})", f"({_lit(alpha, c)} * {b})") if alpha != 1 else (a, b)
        return {"add": f"({a} + {sb})", "sub": f"({a} - {sb})", "rsub": f"({b} - {sa})"}[name], c
    if name == "mul":
        return f"({a} * {b})", c
    if name in ("div", "true_divide"):
        if x.kwargs.get("rounding_mode") is not None or x.const(2) is not None:
            raise RecurrenceError("div with a rounding mode")
        if not c.is_floating_point:
            raise RecurrenceError("integer division")
        return _div(a, b, x, c), c
    fn = "tl.maximum" if name == "maximum" else "tl.minimum"
    return f"{fn}({a}, {b}{_nanprop(c)})", c


def _h_clamp(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    c = _opmath(x.out)
    v = _as(x, 0, c)

    def bound(i: int, kw: str) -> str | None:
        if i < len(x.kinds):
            if x.is_const(i):
                return None if x.consts[i] is None else _lit(x.consts[i], c)
            return _as(x, i, c)
        val = x.kwargs.get(kw)
        return None if val is None else _lit(val, c)

    lo = bound(1, "min") if name in ("clamp", "clamp_min") else None
    hi = bound(2, "max") if name == "clamp" else bound(1, "max") if name == "clamp_max" else None
    if lo is not None:
        v = f"tl.maximum({v}, {lo}{_nanprop(c)})"
    if hi is not None:
        v = f"tl.minimum({v}, {hi}{_nanprop(c)})"
    return v, c


def _h_pow(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    c = _opmath(x.out)
    if x.overload == "Scalar":  # number ** tensor
        base = x.const(0)
        if not isinstance(base, int | float) or isinstance(base, bool) or base <= 0 or not c.is_floating_point:
            raise RecurrenceError("pow of a non-positive or non-constant base")
        e = _as(x, 1, c)
        return (f"(tl.zeros_like({e}) + 1.0)" if base == 1 else f"tl.exp2({e} * {math.log2(base)!r})"), c
    e = x.const(1)
    if x.overload != "Tensor_Scalar" or not isinstance(e, int | float) or isinstance(e, bool):
        raise RecurrenceError("pow with a tensor exponent")
    e = float(e)
    v = _as(x, 0, c)
    if not c.is_floating_point and (e < 0 or not e.is_integer()):
        raise RecurrenceError("integer pow with a negative or fractional exponent")
    if e == 0:
        return f"(tl.zeros_like({v}) + 1)", c
    if e.is_integer() and abs(e) <= 8:
        prod = "(" + " * ".join([v] * int(abs(e))) + ")"
        return (prod if e > 0 else _div("1.0", prod, x, c)), c
    if e == 0.5:
        return (f"tl.sqrt_rn({v})" if x.precise and c == torch.float32 else f"tl.sqrt({v})"), c
    if e == -0.5:
        return f"tl.rsqrt({v})", c
    return f"tl.exp2({e!r} * tl.log2({v}))", c


_UNARY_FLOAT = {
    "exp": "tl.exp({0})", "exp2": "tl.exp2({0})", "log": "tl.log({0})", "log2": "tl.log2({0})",
    "log10": "(tl.log({0}) * 0.4342944819032518)", "rsqrt": "tl.rsqrt({0})", "sigmoid": "tl.sigmoid({0})",
    "tanh": "_tanh({0})", "expm1": "_expm1({0})", "log1p": "_log1p({0})", "erf": "tl.erf({0})",
    "sin": "tl.sin({0})", "cos": "tl.cos({0})", "silu": "({0} / (1.0 + tl.exp(-{0})))",
}  # fmt: skip


def _h_unary(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    c = _opmath(x.out)
    v = _as(x, 0, c)
    if (name in _UNARY_FLOAT or name in ("sqrt", "reciprocal", "gelu")) and not c.is_floating_point:
        raise RecurrenceError(f"{name} of integers")
    if name in _UNARY_FLOAT:
        return _UNARY_FLOAT[name].format(v), c
    if name == "sqrt":
        return (f"tl.sqrt_rn({v})" if x.precise and c == torch.float32 else f"tl.sqrt({v})"), c
    if name == "reciprocal":
        return _div("1.0", v, x, c), c
    if c == torch.bool:
        raise RecurrenceError(f"{name} of booleans")
    if name == "neg":
        return f"(-{v})", c
    if name == "abs":
        return f"tl.abs({v})", c
    if name == "square":
        return f"({v} * {v})", c
    if name == "relu":
        return f"tl.maximum({v}, {_lit(0, c)}{_nanprop(c)})", c
    if name in ("floor", "ceil"):
        return (f"tl.{name}({v})" if c.is_floating_point else v), c
    if name == "gelu":
        approx = x.kwargs.get("approximate", "none")
        if approx == "tanh":
            return f"(0.5 * {v} * (1.0 + _tanh(0.7978845608028654 * ({v} + 0.044715 * {v} * {v} * {v}))))", c
        if approx == "none":
            return f"(0.5 * {v} * (1.0 + tl.erf({v} * 0.7071067811865476)))", c
        raise RecurrenceError(f"gelu approximate={approx!r}")
    if name == "leaky_relu":
        slope = x.const(1, x.kwargs.get("negative_slope", 0.01))
        if len(x.kinds) > 1 and not x.is_const(1):
            raise RecurrenceError("leaky_relu with a tensor slope")
        return f"tl.where({v} > 0, {v}, {v} * {_lit(slope, c)})", c
    raise RecurrenceError(f"unsupported {name}")


_UNARY_OTHER = ("neg", "abs", "sqrt", "reciprocal", "square", "relu", "floor", "ceil", "gelu", "leaky_relu")
_CMP = {"eq": "==", "ne": "!=", "lt": "<", "le": "<=", "gt": ">", "ge": ">="}
_LOGIC = ("logical_and", "logical_or", "logical_xor", "logical_not", "bitwise_and", "bitwise_or", "bitwise_xor",
          "bitwise_not")  # fmt: skip


def _h_cmp(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    c = _opmath(_promoted(x))
    return f"({_as(x, 0, c)} {_CMP[name]} {_as(x, 1, c)})", torch.bool


def _h_logic(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    if name == "logical_not":
        return f"({_as(x, 0, torch.bool)} == 0)", torch.bool
    if name.startswith("logical_"):
        op = {"logical_and": "&", "logical_or": "|", "logical_xor": "^"}[name]
        return f"({_as(x, 0, torch.bool)} {op} {_as(x, 1, torch.bool)})", torch.bool
    c = x.out
    if c.is_floating_point:
        raise RecurrenceError(f"{name} of floats")
    if name == "bitwise_not":
        return (f"({_as(x, 0, c)} == 0)" if c == torch.bool else f"(~{_as(x, 0, c)})"), c
    op = {"bitwise_and": "&", "bitwise_or": "|", "bitwise_xor": "^"}[name]
    return f"({_as(x, 0, c)} {op} {_as(x, 1, c)})", c


def _h_where(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    if len(x.kinds) != 3:
        raise RecurrenceError("where with one argument")
    return f"tl.where({_as(x, 0, torch.bool)}, {_as(x, 1, x.out)}, {_as(x, 2, x.out)})", x.out


def _h_addc(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    c = _opmath(x.out)
    if not c.is_floating_point:
        raise RecurrenceError(f"{name} of integers")
    if len(x.kinds) > 3:
        raise RecurrenceError(f"{name} with a positional value")
    s, t1, t2 = _as(x, 0, c), _as(x, 1, c), _as(x, 2, c)
    value = _lit(x.kwargs.get("value", 1), c)
    if name == "addcmul":
        return f"({s} + {value} * {t1} * {t2})", c
    return f"({s} + {value} * {_div(t1, t2, x, c)})", c


def _h_cast(x: _Ctx, name: str) -> tuple[str, torch.dtype]:
    if x.kinds[0] != "tensor":
        raise RecurrenceError(f"{name} of a number")
    if x.out == torch.bool and x.dtypes[0] != torch.bool:
        return f"({x.exprs[0]} != 0)", torch.bool
    return x.exprs[0], x.dtypes[0]


_POINTWISE: dict[str, Callable[[_Ctx, str], tuple[str, torch.dtype]]] = {
    **dict.fromkeys(("add", "sub", "rsub", "mul", "div", "true_divide", "maximum", "minimum"), _h_arith),
    **dict.fromkeys(("clamp", "clamp_min", "clamp_max"), _h_clamp),
    "pow": _h_pow,
    **dict.fromkeys((*_UNARY_FLOAT, *_UNARY_OTHER), _h_unary),
    **dict.fromkeys(_CMP, _h_cmp),
    **dict.fromkeys(_LOGIC, _h_logic),
    "where": _h_where,
    **dict.fromkeys(("addcmul", "addcdiv"), _h_addc),
    **dict.fromkeys(_CASTS | _IDENTITY | _RESHAPE, _h_cast),
}


def _item_expr(it: _Item, operand: Callable[[_Ref], tuple[str, torch.dtype | None]], precise: bool) -> str:
    exprs, kinds, dtypes, consts = [], [], [], []
    args = it.args[:1] if it.op in _CASTS or it.op in _IDENTITY or it.op in _RESHAPE else it.args
    for r in args:
        if r.kind == "const":
            exprs.append("")
            kinds.append("const")
            dtypes.append(None)
            consts.append(r.i)
            continue
        e, d = operand(r)
        exprs.append(e)
        kinds.append(r.kind if r.kind in ("step", "tlen") else "tensor")
        dtypes.append(d)
        consts.append(None)
    x = _Ctx(exprs, kinds, dtypes, consts, it.metas, it.kwargs, it.dtype, precise, it.overload)
    expr, have = _POINTWISE[it.op](x, it.op)
    return _cast_expr(expr, have, it.dtype)


def _cast_expr(expr: str, have: torch.dtype | None, want: torch.dtype) -> str:
    if have == want:
        return expr
    if want == torch.bool:
        return f"({expr} != 0)"
    if want == torch.bfloat16:
        return f"_cast_out({expr}, tl.bfloat16)"
    return f"({expr}).to({_TL[want]})"


# ------------------------------------------------------------------------------------------
# recognition


@dataclass
class RecCase:
    """One input signature (the loop dimension wildcarded) and its plan."""

    key: tuple
    wild: tuple[tuple[int, int], ...]  # (input, dim) positions that hold the loop length (plus a constant)
    tpos: tuple[int, int, int]  # T = args[i].shape[d] - c
    tmin: int  # the shortest loop length checked (shorter ones run the reference)
    workloads: list[int]
    gm: torch.fx.GraphModule  # the trace of length a (its prefix and suffix are emitted)
    template: _Template
    plan: _Plan


@dataclass
class Recurrence:
    axis: str
    cases: list[RecCase]
    uncovered: list[int] = field(default_factory=list)

    def describe(self) -> str:
        c = self.cases[0]
        g, p = c.template.geo, c.plan
        stores = sum(it.kind == "store" for it in p.items)
        return (f"recurrence over {self.axis}: {g.s} ops before the loop, {g.P} per step ({len(p.states)} "
                f"carried, {stores} stored per step), {g.n_suf} after; lanes {list(p.L)}; {len(self.cases)} "
                "case(s)")  # fmt: skip


def _variant(task: Any, index: int, axes: Mapping[str, int]) -> Any | None:
    """``task`` reduced to workload ``index`` with ``axes`` (None where the definition's constraints refuse them)."""
    from kernelarc.tasks.loader import TaskError, resolve_axes

    try:
        resolve_axes(task.definition, dict(axes))
    except (TaskError, ValueError, ZeroDivisionError, KeyError):
        return None
    wl = task.workloads[index].model_copy(update={"axes": dict(axes)})
    return dataclasses.replace(task, workloads=[wl])


def _inputs(task: Any, index: int, axes: Mapping[str, int]) -> list[Any] | None:
    t = _variant(task, index, axes)
    if t is None:
        return None
    try:
        return example_inputs(t, 0)
    except Exception:  # noqa: BLE001 - generators that need real data, shapes the definition refuses
        return None


def _trace(fn: Any, args: list[Any]) -> torch.fx.GraphModule | None:
    try:
        return trace(fn, args, symbolic=False)
    except CaptureError:
        return None


def _count(gm: torch.fx.GraphModule) -> int:
    return sum(n.op != "output" for n in gm.graph.nodes)


def _loop_axes(task: Any, fn: Any) -> list[str]:
    """Var axes along which the traced graph grows linearly (the other var axes small where the definition
    allows, else as the first workload has them)."""
    from kernelarc.tasks.schema import AxisVar

    var = [n for n, a in task.definition.axes.items() if isinstance(a, AxisVar)]
    given = dict(task.workloads[0].axes)
    out = []
    for ax in var:
        for others in ({n: 2 for n in var}, given):
            counts = []
            for T in SMALL:
                args = _inputs(task, 0, {**given, **others, ax: T})
                gm = _trace(fn, args) if args is not None else None
                if gm is None:
                    break
                counts.append(_count(gm))
            if len(counts) == len(SMALL):
                steps = {b - a for a, b in zip(counts, counts[1:], strict=False)}
                if len(steps) == 1 and steps.pop() > 0:
                    out.append(ax)
                break
    return out


def _sig(args: Sequence[Any], wild: set[tuple[int, int]]) -> tuple:
    """``capture.signature`` with the loop dimensions as -1 (the candidate computes the same expression)."""
    return tuple(
        (tuple(-1 if (i, d) in wild else int(s) for d, s in enumerate(a.shape)), str(a.dtype))
        if isinstance(a, torch.Tensor) else repr(a)
        for i, a in enumerate(args)
    )  # fmt: skip


def _wild(sigs: Mapping[int, list[Any]]) -> tuple[set[tuple[int, int]], tuple[int, int, int]]:
    """Input dimensions that follow the loop length (T + c) across the small traces; nothing else may move."""
    Ts = sorted(sigs)
    first = sigs[Ts[0]]
    wild: set[tuple[int, int]] = set()
    tpos: tuple[int, int, int] | None = None
    for i, a in enumerate(first):
        others = [sigs[T][i] for T in Ts]
        if not isinstance(a, torch.Tensor):
            if any(repr(o) != repr(a) for o in others):
                raise RecurrenceError("a scalar input changes with the loop length")
            continue
        if any(not isinstance(o, torch.Tensor) or o.dim() != a.dim() or o.dtype != a.dtype for o in others):
            raise RecurrenceError("an input changes rank or dtype with the loop length")
        for d in range(a.dim()):
            vals = [int(sigs[T][i].shape[d]) for T in Ts]
            if len(set(vals)) == 1:
                continue
            cs = {v - T for v, T in zip(vals, Ts, strict=True)}
            if len(cs) != 1:
                raise RecurrenceError("an input dimension depends on the loop length other than as its length")
            c = cs.pop()
            wild.add((i, d))
            if tpos is None or (c == 0 and tpos[2] != 0):
                tpos = (i, d, c)
    if tpos is None:
        raise RecurrenceError("no input dimension holds the loop length")
    return wild, tpos


def _case(task: Any, fn: Any, axis: str, index: int) -> RecCase:
    given = dict(task.workloads[index].axes)
    args: dict[int, list[Any]] = {}
    gms: dict[int, torch.fx.GraphModule] = {}
    for T in SMALL:
        a = _inputs(task, index, {**given, axis: T})
        if a is None:
            raise RecurrenceError(f"inputs with {axis}={T} cannot be built (constraints or the input generator)")
        gm = _trace(fn, a)
        if gm is None:
            raise RecurrenceError(f"the reference does not trace with {axis}={T}")
        args[T], gms[T] = a, gm
    wild, tpos = _wild(args)
    a0 = SMALL[0]
    tpl = _template(gms[a0], gms[a0 + 1], a0)
    for T in SMALL[2:]:
        if not tpl.matches(_split(gms[T], T, tpl.geo), T):
            raise RecurrenceError(f"the trace of length {T} does not repeat the per-step block")
    tmin = a0
    for T in sorted(SHORT, reverse=True):
        if T + tpl.geo.dk < 1 or tmin - 1 != T:
            break
        a = _inputs(task, index, {**given, axis: T})
        gm = _trace(fn, a) if a is not None else None
        try:
            ok = gm is not None and tpl.matches(_split(gm, T, tpl.geo), T)
        except RecurrenceError:
            ok = False
        if not ok:
            break
        tmin = T
    plan = _Analysis(tpl, gms[a0], gms[a0 + 1]).run()
    for precise in (True, False):  # everything the renderer writes is checked here, not at the first render
        _kernel_src("_check", plan, 2, precise, precise)
    key = _sig(args[a0], wild)
    rc = RecCase(key, tuple(sorted(wild)), tpos, tmin, [], gms[a0], tpl, plan)
    _prefix_suffix_lines(rc)
    return rc


def recognise_recurrence(task: Any) -> Recurrence:
    """The per-step recurrence in ``task``'s reference; RecurrenceError when there is none this module emits."""
    from kernelarc.tasks.inputs import load_module

    try:
        mod = load_module(task.definition.reference, f"reference_recurrence_{task.name}")
    except Exception as e:  # noqa: BLE001
        raise RecurrenceError(f"reference does not import: {type(e).__name__}: {e}") from e
    fn = getattr(mod, "run", None)
    if fn is None:
        raise RecurrenceError("reference defines no run()")
    axes = _loop_axes(task, fn)
    if not axes:
        raise RecurrenceError("no var axis makes the traced graph grow linearly (no per-step loop found)")
    errors: list[str] = []
    for axis in axes:
        try:
            rec = _recognise_axis(task, fn, axis)
        except RecurrenceError as e:
            errors.append(f"loop over {axis}: {e}")
            continue
        # the emitted module parses (checked once here: CPython 3.11's ast module is not safe to use from
        # several threads at once, and the search renders points in its agents' threads)
        try:
            import ast

            ast.parse(render_recurrence(task.name, rec, task.definition.reference, {}))
        except SyntaxError as e:
            raise RecurrenceError(f"emitted source does not parse: {e}") from e
        return rec
    raise RecurrenceError("; ".join(errors))


def _recognise_axis(task: Any, fn: Any, axis: str) -> Recurrence:
    # the workloads by their input signature with the loop dimension wildcarded
    groups: dict[tuple, list[int]] = {}
    uncovered: list[int] = []
    for i, wl in enumerate(task.workloads):
        sigs = {T: _inputs(task, i, {**wl.axes, axis: T}) for T in SMALL}
        real = _inputs(task, i, dict(wl.axes))
        if real is None or any(v is None for v in sigs.values()):
            uncovered.append(i)
            continue
        try:
            wild, _tpos = _wild(sigs)  # type: ignore[arg-type]
        except RecurrenceError:
            uncovered.append(i)
            continue
        key = _sig(real, wild)
        if key != _sig(sigs[SMALL[0]], wild):  # type: ignore[arg-type]
            uncovered.append(i)
            continue
        groups.setdefault(key, []).append(i)
    cases: list[RecCase] = []
    first_error: str | None = None
    for n, (key, members) in enumerate(groups.items()):
        if n >= MAX_CONCRETE_CASES:
            uncovered += members
            continue
        try:
            case = _case(task, fn, axis, members[0])
        except RecurrenceError as e:
            first_error = first_error or str(e)
            log.info("%s: workloads %s not served by the recurrence kernel: %s", task.name, members, e)
            uncovered += members
            continue
        if case.key != key:
            uncovered += members
            continue
        case.workloads = members
        cases.append(case)
    if not cases:
        raise RecurrenceError(first_error or "no workload's inputs can be built for small loop lengths")
    return Recurrence(axis, cases, sorted(uncovered))


# ------------------------------------------------------------------------------------------
# rendering


_HEAD = (
    """
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_INF = tl.constexpr(math.inf)
_NAN = tl.constexpr(math.nan)

"""
    + CAST_OUT
)

# Triton's libdevice functions do not run in its interpreter: tanh, expm1, log1p from exp / log, with
# series near zero (where 1 - exp and log(1 + x) cancel), within a few fp32 ulp
_HELPERS = {
    "tanh": """
@triton.jit
def _tanh(x):
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    big = (1.0 - e) / (1.0 + e)
    x2 = ax * ax
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    y = tl.where(ax < 0.0625, small, big)
    return tl.where(x < 0, -y, y)
""",
    "expm1": """
@triton.jit
def _expm1(x):
    small = x * (1.0 + x * (0.5 + x * (0.16666666666666666 + x * (0.041666666666666664 + x * (
        0.008333333333333333 + x * 0.001388888888888889)))))
    return tl.where(tl.abs(x) < 0.0625, small, tl.exp(x) - 1.0)
""",
    "log1p": """
@triton.jit
def _log1p(x):
    small = x * (1.0 + x * (-0.5 + x * (0.3333333333333333 + x * (-0.25 + x * (0.2 + x * (
        -0.16666666666666666 + x * 0.14285714285714285))))))
    return tl.where(tl.abs(x) < 0.0625, small, tl.log(1.0 + x))
""",
}


def _helpers_used(plans: Sequence[_Plan]) -> list[str]:
    gelu_tanh = any(it.kind == "value" and it.op == "gelu" and it.kwargs.get("approximate") == "tanh"
                    for p in plans for it in p.items)  # fmt: skip
    return [h for h in _HELPERS if any(p.uses(h) for p in plans) or (h == "tanh" and gelu_tanh)]


def _kernel_src(fname: str, plan: _Plan, unroll: int, precise: bool, prefetch: bool = False) -> tuple[str, list[str]]:
    """The Triton kernel of one case, and the launch arguments after the pointers (run side)."""
    L = plan.L
    lane = [d for d in range(len(L)) if L[d] > 1]
    spans: dict[int, list[int]] = {}
    for p, ptr in enumerate(plan.ptrs):
        aligned = (1,) * (len(L) - len(ptr.shape)) + tuple(ptr.shape)
        spans[p] = [d for d in lane if aligned[d] == L[d]]
    params = [f"P{p}" for p in range(len(plan.ptrs))]
    launch: list[str] = []
    for p in range(len(plan.ptrs)):
        params += [f"S{p}_{d}" for d in spans[p]]
        launch += [f"a{p}.stride({d})" for d in spans[p]]
    for p, ptr in enumerate(plan.ptrs):
        if ptr.loop is not None:
            params.append(f"LS{p}")
            launch.append(ptr.loop)
    params += ["N", "T", "K", *[f"D{d}" for d in lane], "BLOCK: tl.constexpr"]
    launch += ["N", "T", "K", *[str(L[d]) for d in lane]]
    body = ["pid = tl.program_id(0)", "lane = pid * BLOCK + tl.arange(0, BLOCK)", "mask = lane < N",
            "zero = tl.zeros([BLOCK], dtype=tl.int64)"]  # fmt: skip
    if lane:  # the lane's multi-index in L (row-major), in int64 for the address arithmetic
        body.append("rem = lane")
        for n, d in enumerate(reversed(lane)):
            if n == len(lane) - 1:
                body.append(f"i{d} = rem.to(tl.int64)")
            else:
                body += [f"i{d} = (rem % D{d}).to(tl.int64)", f"rem = rem // D{d}"]
    for p in range(len(plan.ptrs)):
        body.append(f"b{p} = P{p} + (zero" + "".join(f" + i{d} * S{p}_{d}" for d in spans[p]) + ")")
    for p, ptr in enumerate(plan.ptrs):
        if ptr.role == "in":
            body.append(f"o{p} = tl.load(b{p}, mask=mask, other=0)")

    def operand(r: _Ref, tag: str, u: int) -> tuple[str, torch.dtype | None]:
        if r.kind == "ptr":
            ptr = plan.ptrs[r.i]
            return (f"o{r.i}" if ptr.role == "in" else f"x{r.i}_{tag}{u}"), ptr.dtype
        if r.kind == "node":
            it = plan.item(r.i)
            assert it is not None
            return (f"c{r.i}" if it.invariant else f"v{r.i}_{tag}"), it.dtype
        if r.kind == "state":
            return f"s{r.i}", plan.dtype(r)
        if r.kind == "step":
            tv = f"(tv + {u})" if u else "tv"
            k = f"(K - 1 - {tv})" if r.rev else tv
            if r.i != 1 or not isinstance(r.off, int):  # a number computed from the index: in fp32
                return f"({k} * {float(r.i)!r} + {float(r.off)!r})", None
            return (f"({k} + {r.off})" if r.off else k), None
        if r.kind == "tlen":
            return f"({_tlen_src(r.i)})", None
        raise RecurrenceError(f"internal: no kernel operand for {r}")

    for it in plan.items:
        if it.kind == "value" and it.invariant:
            body.append(f"c{it.j} = {_item_expr(it, lambda r: operand(r, 'a', 0), precise)}")
    for j, (_val, ip) in plan.states.items():
        body.append(f"s{j} = o{ip}")
    carried: dict[int, _Ref] = {}  # exported per-step values kept across iterations
    for j, (val, _p) in plan.exports.items():
        if j not in plan.states and not plan.invariant(val):
            carried[j] = val
            body.append(f"e{j} = tl.zeros([BLOCK], dtype={_TL[plan.dtype(val)]})")
    if plan.step_used:
        body.append("tv = tl.zeros([BLOCK], dtype=tl.int32)")
    step_ptrs = [p for p, ptr in enumerate(plan.ptrs) if ptr.role == "step"]
    moving = step_ptrs + [p for p, ptr in enumerate(plan.ptrs) if ptr.role == "store" and ptr.loop is not None]

    def stored(it: _Item, tag: str, u: int) -> str:
        r, ptr = it.args[0], plan.ptrs[it.ptr]
        if r.kind == "const":
            v = r.i
            if not isinstance(v, bool | int | float):
                raise RecurrenceError(f"a per-step store of {v!r}")
            lit = _lit(v, ptr.dtype) if ptr.dtype != torch.float64 else repr(float(v))
            return f"tl.full([BLOCK], {lit}, {_TL[ptr.dtype]})"
        e, dt = operand(r, tag, u)
        return e if dt == ptr.dtype else f"_cast_out({e}, P{it.ptr}.dtype.element_ty)"

    def substep(tag: str, u: int) -> list[str]:
        lines = []
        for it in plan.items:
            if it.kind == "value" and not it.invariant:
                lines.append(f"v{it.j}_{tag} = {_item_expr(it, lambda r: operand(r, tag, u), precise)}")
            elif it.kind == "store":
                moves = plan.ptrs[it.ptr].loop is not None and u > 0
                at = f"b{it.ptr} + {u} * LS{it.ptr}" if moves else f"b{it.ptr}"
                lines.append(f"tl.store({at}, {stored(it, tag, u)}, mask=mask)")
        lines += [f"s{j} = {operand(val, tag, u)[0]}" for j, (val, _ip) in plan.states.items()]
        lines += [f"e{j} = {operand(val, tag, u)[0]}" for j, val in carried.items()]
        return lines

    def loads(tag: str, n: int, first: int = 0, where: str = "mask") -> list[str]:
        return [f"x{p}_{tag}{u} = tl.load({f'b{p} + {u + first} * LS{p}' if u + first else f'b{p}'}, mask={where}, "
                "other=0)" for u in range(n) for p in step_ptrs]  # fmt: skip

    def advance(n: int) -> list[str]:
        out = [f"b{p} += {n} * LS{p}" if n > 1 else f"b{p} += LS{p}" for p in moving]
        return out + ([f"tv += {n}"] if plan.step_used else [])

    if unroll > 1 and prefetch and step_ptrs:
        # the next UNROLL steps' loads are issued before this chunk's steps compute (double buffering)
        body += [f"km = K - K % {unroll}", *loads("n", unroll, 0, "mask & (km > 0)")]
        chunk = [f"x{p}_u{u} = x{p}_n{u}" for u in range(unroll) for p in step_ptrs]
        chunk += loads("n", unroll, unroll, f"mask & (_t + {unroll} < km)")
        for u in range(unroll):
            chunk += substep("u", u)
        chunk += advance(unroll)
        body += [f"for _t in range(0, km, {unroll}):", *["    " + ln for ln in chunk]]
        body.append("for _t in range(km, K):")
    elif unroll > 1:  # UNROLL steps per iteration, their per-step loads issued together; then the rest one by one
        chunk = loads("u", unroll)
        for u in range(unroll):
            chunk += substep("u", u)
        chunk += advance(unroll)
        body += [f"km = K - K % {unroll}", f"for _t in range(0, km, {unroll}):", *["    " + ln for ln in chunk]]
        body.append("for _t in range(km, K):")
    else:
        body.append("for _t in range(0, K):")
    body += ["    " + ln for ln in loads("r", 1) + substep("r", 0) + advance(1)]
    for j, (val, p) in plan.exports.items():
        ptr = plan.ptrs[p]
        aligned = (1,) * (len(L) - len(ptr.shape)) + tuple(ptr.shape)
        canon = "".join(f" & (i{d} == 0)" for d in lane if aligned[d] != L[d])  # broadcast dims: one lane stores
        e = f"s{j}" if j in plan.states else f"e{j}" if j in carried else operand(val, "a", 0)[0]
        e = e if plan.dtype(val) == ptr.dtype else f"_cast_out({e}, P{p}.dtype.element_ty)"
        body.append(f"tl.store(b{p}, {e}, mask=mask{canon})")
    src = ["@triton.jit", f"def {fname}({', '.join(params)}):", *["    " + ln for ln in body]]
    return "\n".join(src), launch


def _prefix_suffix_lines(case: RecCase) -> tuple[list[str], list[str], str]:
    """Run-side prefix lines, suffix lines and the returned expression, from the trace of length a, with the
    integers that follow the loop length written as ``T + c``."""
    tpl, plan = case.template, case.plan
    g = tpl.geo
    ns = [n for n in case.gm.graph.nodes if n.op != "output"]
    out_node = next(n for n in case.gm.graph.nodes if n.op == "output")
    start = g.n_ph + g.s
    K = tpl.a + g.dk
    end = start + K * g.P
    known: set[Node] = set(ns[: g.n_ph])
    base = _namer(known, " (recurrence prefix/suffix)")
    last = {ns[start + (K - 1) * g.P + j]: name for j, name in plan.run_names.items()}

    def name(x: Any) -> str:
        if isinstance(x, Node) and x in last:
            return last[x]
        return base(x)

    def subst(v: Any, t: Any) -> Any:
        if isinstance(t, TLen):
            return _TFloat(float(v), t.c) if t.fl else _TInt(int(v), t.c)
        if isinstance(v, list | tuple) and isinstance(t, list | tuple) and len(v) == len(t):
            return type(v)(subst(x, y) for x, y in zip(v, t, strict=True))
        return v

    unfilled = {ns[i] for i in plan.unfilled}

    def line(n: Node, t: tuple) -> str:
        _key_, targs, tkw = t
        args = subst(n.args, targs)
        tk = dict(tkw)
        kw = {k: subst(v, tk.get(k)) for k, v in n.kwargs.items()}
        if n.target is operator.getitem:
            return f"{_var(n)} = {name(args[0])}[{_fmt(args[1], name)}]"
        callee = _callee(n.target)
        if n in unfilled:  # every element is stored by the kernel: no fill pass
            new, drop = _UNFILLED[_opname(n.target)]
            callee = f"torch.ops.aten.{new}"
            args = tuple(a for i, a in enumerate(args) if i != drop)
        parts = [_fmt(x, name) for x in args] + [f"{k}={_fmt(v, name)}" for k, v in kw.items()]
        return f"{_var(n)} = {callee}({', '.join(parts)})"

    pre, suf = [], []
    for n, t in zip(ns[g.n_ph : start], tpl.prefix, strict=True):
        pre.append(line(n, t))
        known.add(n)
    for n, t in zip(ns[end:], tpl.suffix[:-1], strict=True):
        suf.append(line(n, t))
        known.add(n)
    ret = _fmt(subst(out_node.args[0], tpl.suffix[-1][1][0]), name)
    return pre, suf, ret


def _case_src(fname: str, case: RecCase, kname: str, launch: list[str]) -> list[str]:
    plan, g = case.plan, case.template.geo
    phs = [n for n in case.gm.graph.nodes if n.op == "placeholder"]
    pre, suf, ret = _prefix_suffix_lines(case)
    i, d, c = case.tpos
    body = []
    tensors = [p for p in phs if isinstance(p.meta.get("val"), torch.Tensor)]
    if tensors:
        body.append(f"_dev = {_var(tensors[0])}.device")
    body.append(f"T = {_var(phs[i])}.shape[{d}]" + (f" - {c}" if c > 0 else f" + {-c}" if c < 0 else ""))
    body.append(f"K = T + {g.dk}" if g.dk else "K = T")
    body += pre + plan.hoisted
    L = tuple(plan.L)
    body.append(f"N = {math.prod(L)}")
    for _j, (_val, p) in plan.exports.items():
        ptr = plan.ptrs[p]
        body.append(f"{ptr.run} = torch.empty({tuple(ptr.shape)!r}, dtype={ptr.dtype}, device=_dev)")
    inner = [f"a{p} = torch.broadcast_to({ptr.run}, {L!r})" for p, ptr in enumerate(plan.ptrs)]
    args = ", ".join([f"a{p}" for p in range(len(plan.ptrs))] + launch)
    inner.append("block = _lanes_per_program(N)")
    inner.append(f"{kname}[(triton.cdiv(N, block),)]({args}, BLOCK=block, num_warps=NUM_WARPS)")
    body += ["if N > 0:", *["    " + ln for ln in inner], *suf, f"return {ret}"]
    return [f"def {fname}({', '.join(_var(p) for p in phs)}):", *["    " + ln for ln in body]]


RUNTIME = """

def _lanes_per_program(n):
    # Triton's interpreter runs one program after the other, each step as numpy calls: one program over all
    # lanes there (the same kernel, masked the same way); BLOCK lanes per program on the GPU
    if INTERPRET:
        return min(triton.next_power_of_2(max(n, 1)), 1 << 17)
    return BLOCK


def _kernelarc_rsig(args, wild):
    return tuple(
        (tuple(-1 if (i, d) in wild else s for d, s in enumerate(a.shape)), str(a.dtype))
        if isinstance(a, torch.Tensor) else repr(a)
        for i, a in enumerate(args)
    )


def run(*args):
    # only the input signatures the loop was traced and checked for (the loop dimension free), loops at least
    # as long as the shortest checked; anything else runs the reference
    for wild, (i, d, c), tmin, key, fn in _CASES:
        if _kernelarc_rsig(args, wild) == key:
            if args[i].shape[d] - c >= tmin:
                with torch.no_grad():
                    return fn(*args)
            break
    return _ref_run(*args)
"""


def render_recurrence(title: str, rec: Recurrence, reference: str, knobs: Mapping[str, Any]) -> str:
    """The candidate source for ``knobs`` (BLOCK, num_warps, UNROLL, PREFETCH, precision; defaults KNOB_DEFAULTS)."""
    from kernelarc.dispatch import CompositionError as DispatchCompositionError
    from kernelarc.dispatch import rename_part

    k = {**KNOB_DEFAULTS, **knobs}
    unroll, precise, prefetch = int(k["UNROLL"]), k["precision"] == "ieee", bool(k["PREFETCH"])
    try:
        ref = rename_part(drop_main_guard(reference), "_ref_")
    except DispatchCompositionError as e:
        raise RecurrenceError(str(e)) from e
    bound = {"math": "import math", "os": "import os", "torch": "import torch", "triton": "import triton",
             "tl": "import triton.language as tl"}  # fmt: skip
    imports = list(bound.values())
    for text, names in ref.imports:
        for n in names:
            if n in bound and bound[n] != text and n != "torch":
                raise RecurrenceError(f"the reference binds {n!r} as {text!r}")
        if text not in imports:
            imports.append(text)
    imports.sort(key=lambda t: not t.startswith("from __future__"))
    knob_lines = "\n".join(f"    {n} = {v!r}" for n, v in sorted(k.items()))
    doc = (f"KernelArc candidate for {title}: the reference's per-step loop as one Triton kernel "
           f"(kernelarc.graph.recurrence).\n\n{rec.describe()}\n\nKnobs:\n{knob_lines}\n")  # fmt: skip
    out = ['"""' + doc.replace('"""', "'''") + '"""', "", *imports, _HEAD]
    out += [_HELPERS[h] for h in _helpers_used([c.plan for c in rec.cases])]
    out += ["", f"BLOCK = {int(k['BLOCK'])}", f"NUM_WARPS = {int(k['num_warps'])}", "", "", "# ---- part _ref_", "",
            ref.body]  # fmt: skip
    kernels: dict[str, str] = {}
    table = []
    for ci, case in enumerate(rec.cases):
        text, launch = _kernel_src("_KERNEL_", case.plan, unroll, precise, prefetch)
        kname = kernels.get(text)
        if kname is None:
            kname = kernels[text] = f"_rk{len(kernels)}"
            out += ["", "", text.replace("_KERNEL_", kname)]
        out += ["", "", *_case_src(f"_case{ci}", case, kname, launch)]
        table.append(f"    ({case.wild!r}, {case.tpos!r}, {case.tmin}, {case.key!r}, _case{ci}),")
    out += ["", "", "_CASES = (", *table, ")", RUNTIME]
    return "\n".join(out)
