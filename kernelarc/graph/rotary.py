"""Rotary position embeddings (RoPE) applied to a tensor, in the forms models write them.

* ``rotate_half`` (NeoX / Llama): ``x * cos + rotate_half(x) * sin`` with
  ``rotate_half(x) = cat(-x[..., h:], x[..., :h])``; cos / sin span the whole head dim.
* ``split_halves``: ``cat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)`` over the two halves of x;
  cos / sin span half the head dim.
* ``interleaved`` (GPT-J / Meta): pairs (x[2i], x[2i+1]) rotated, as ``stack(xe * cos - xo * sin,
  xe * sin + xo * cos, -1).flatten(-2)`` over ``x[..., ::2]`` / ``x[..., 1::2]`` (or the
  ``[..., 0]`` / ``[..., 1]`` of a ``(.., D/2, 2)`` view), or as complex multiplication
  (``view_as_complex(x.reshape(.., -1, 2)) * freqs_cis``, then ``view_as_real`` and flatten).

The built-in RoPE families rotate halves with one cos / sin value per pair: a rotate-half site maps
onto them only when cos and sin are provably the same on both halves (``cat(f, f)`` before the
``cos``, through the casts, scalings, broadcasts and per-token gathers models apply), which
``params["dup_halves"]`` records. Random cos / sin inputs (as some problems pass) are not: such a
site stays on the graph's own ops.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import node_dtype, node_rank, node_shape
from kernelarc.graph.patterns import TRANSPARENT, Kind, Site, _half, _site, arg, is_last_dim, op, same, scalar, strip


def _dt(n: Any) -> str:
    return str(node_dtype(n)).replace("torch.", "")


def _rotate_half_of(n: Any) -> Node | None:
    """x when n is cat([-x[..., h:], x[..., :h]], -1)."""
    if op(n) != "cat" or len(n.args[0]) != 2 or not is_last_dim(arg(n, 1, "dim", 0), node_rank(n)):
        return None
    a, b = n.args[0]
    if op(a) == "neg":
        ha, hb = _half(a.args[0]), _half(b)
        if ha and hb and ha[0] is hb[0] and ha[1] == 1 and hb[1] == 0:
            return ha[0]
    return None


def _flat_pair_stack(n: Any) -> tuple[Node, Node] | None:
    """(a, b) when n is stack([a, b], -1) flattened over its last two dims (flatten / view / reshape):
    the interleaving both the rotate-every-two and the interleaved RoPE forms end with."""
    if op(n) not in ("flatten", "view", "reshape", "_unsafe_view"):
        return None
    st = strip(n.args[0])
    if op(st) != "stack" or len(st.args[0]) != 2 or not is_last_dim(arg(st, 1, "dim", 0), node_rank(st)):
        return None
    a, b = st.args[0]
    return a, b


def _rotate_pairs_of(n: Any) -> Node | None:
    """x when n is stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2) (GPT-J's rotate_every_two)."""
    pair = _flat_pair_stack(n)
    if pair is None:
        return None
    a, b = pair
    if op(a) != "neg":
        return None
    pa, pb = _pair_of(a.args[0]), _pair_of(b)
    if pa and pb and strip(pa[0]) is strip(pb[0]) and (pa[1], pb[1]) == (1, 0):
        return pa[0]
    return None


def dup_halves(n: Any) -> bool:
    """The last dim of ``n`` is provably two equal halves: cat([f, f], -1) (or repeat(.., 2)) behind
    casts, scalar scalings, cos / sin, broadcasts and gathers over the leading dims."""
    return _duplicated(n, pairs=False)


def _whole_slice(n: Node) -> bool:
    start, end, step = arg(n, 2, "start", 0), arg(n, 3, "end", None), arg(n, 4, "step", 1)
    return start in (0, None) and step == 1 and (end is None or (isinstance(end, int) and end >= 2**62))


def dup_pairs(n: Any) -> bool:
    """The last dim of ``n`` provably holds each value twice in a row (one per rotated pair):
    repeat_interleave(f, 2, -1) or stack([f, f], -1).flatten(-2), behind the same ops as dup_halves."""
    return _duplicated(n, pairs=True)


def _duplicated(n: Any, pairs: bool) -> bool:
    for _ in range(16):
        o = op(n)
        if o is None:
            return False
        rank = node_rank(n)
        if (
            o in TRANSPARENT
            or o in ("unsqueeze", "expand", "cos", "sin", "neg")
            or o in ("mul", "div")
            and scalar(n.args[1]) is not None
        ):
            n = n.args[0]
        elif o == "mul" and scalar(n.args[0]) is not None:
            n = n.args[1]
        elif (o in ("slice", "select", "index_select") and not is_last_dim(arg(n, 1, "dim", 0), rank)) or (
            o == "slice" and _whole_slice(n)  # x[..., :] of an indexing expression: the identity
        ):
            n = n.args[0]
        elif o == "index" and isinstance(n.args[1], list | tuple) and len(n.args[1]) < (node_rank(n.args[0]) or 0):
            n = n.args[0]  # advanced indexing over leading dims only (positions into a table)
        elif o == "embedding":
            n = n.args[0]
        elif pairs:
            if o == "repeat_interleave":
                return scalar(arg(n, 1, "repeats")) == 2.0 and is_last_dim(arg(n, 2, "dim"), rank)
            st = _flat_pair_stack(n)
            return st is not None and isinstance(st[0], Node) and strip(st[0]) is strip(st[1])
        elif o == "cat":
            parts = n.args[0]
            return (
                len(parts) == 2
                and is_last_dim(arg(n, 1, "dim", 0), rank)
                and isinstance(parts[0], Node)
                and strip(parts[0]) is strip(parts[1])
            )
        elif o == "repeat":
            reps = list(n.args[1])
            return len(reps) >= 1 and reps[-1] == 2 and all(r == 1 for r in reps[:-1])
        else:
            return False
    return False


def _mul_parts(m: Any) -> tuple[Any, Any] | None:
    return (m.args[0], m.args[1]) if op(m) == "mul" and len(m.args) == 2 else None


def _out_node(n: Node) -> Node:
    users = list(n.users)
    if len(users) == 1 and op(users[0]) in ("to", "_to_copy") and not users[0].kwargs.get("device"):
        return users[0]
    return n


def _with_source(last: Node, x: Node, rest: dict[str, Any], params: dict[str, Any]) -> Site | None:
    """The site reading x before the cast the reference applied (x.float()) when the result is cast
    back to that dtype (the kernel computes in fp32 and stores in x's dtype), else x as the graph reads it."""
    xs = strip(x)
    if xs is not x and _dt(xs) == params["out_dtype"]:
        site = _site(Kind.rope, last, {"x": xs, **rest}, params)
        if site is not None:
            return site
    return _site(Kind.rope, last, {"x": x, **rest}, params)


def _rotate_half_site(n: Node) -> Site | None:
    m1, m2 = n.args[0], n.args[1]
    if not (_mul_parts(m1) and _mul_parts(m2)):
        return None
    for xc, rs in ((m1, m2), (m2, m1)):
        for i in (0, 1):
            rot = _rotate_half_of(rs.args[i])
            style = "rotate_half"
            if rot is None:
                rot, style = _rotate_pairs_of(rs.args[i]), "interleaved"
            if rot is None:
                continue
            sin = rs.args[1 - i]
            x = xc.args[0] if same(xc.args[0], rot) else xc.args[1] if same(xc.args[1], rot) else None
            if x is None:
                continue
            cos = xc.args[1] if x is xc.args[0] else xc.args[0]
            if not (isinstance(cos, Node) and isinstance(sin, Node)):
                continue
            last = _out_node(n)
            dup = style == "rotate_half" and dup_halves(cos) and dup_halves(sin)
            params = {"style": style, "dup_halves": dup, "half_width": False, "out_dtype": _dt(last)}
            if style == "interleaved":  # full-width cos / sin: one value per pair, twice
                params["dup_pairs"] = dup_pairs(cos) and dup_pairs(sin)
            return _with_source(last, x, {"cos": cos, "sin": sin}, params)
    return None


def _half_terms(t: Any, x: Node) -> tuple[int, Any] | None:
    """(which half of x, the other factor) when t is x-half * other."""
    parts = _mul_parts(t)
    if parts is None:
        return None
    for a, b in (parts, parts[::-1]):
        h = _half(strip(a))
        if h is not None and strip(h[0]) is strip(x):
            return h[1], b
    return None


def _split_halves_site(n: Node) -> Site | None:
    """cat([x1 * c - x2 * s, x2 * c + x1 * s], -1) (either order of the add's terms)."""
    sub, add = n.args[0]
    if op(sub) != "sub" or op(add) != "add":
        return None
    x = None
    for t in (*sub.args[:2], *add.args[:2]):
        for a in _mul_parts(t) or ():
            h = _half(strip(a)) if isinstance(a, Node) else None
            if h is not None and x is None:
                x = h[0]
    if x is None:
        return None
    a, b = _half_terms(sub.args[0], x), _half_terms(sub.args[1], x)
    c, d = _half_terms(add.args[0], x), _half_terms(add.args[1], x)
    if not (a and b and c and d):
        return None
    if (a[0], b[0]) != (0, 1):
        return None
    # x2 * cos + x1 * sin, in either order
    terms = {c[0]: c[1], d[0]: d[1]}
    if set(terms) != {0, 1}:
        return None
    cos, sin = a[1], b[1]
    if not (same(terms[1], cos) or terms[1] is cos) or not (same(terms[0], sin) or terms[0] is sin):
        return None
    if not (isinstance(cos, Node) and isinstance(sin, Node)):
        return None
    last = _out_node(n)
    params = {"style": "split_halves", "dup_halves": True, "half_width": True, "out_dtype": _dt(last)}
    return _with_source(last, x, {"cos": cos, "sin": sin}, params)


def _pair_of(t: Any) -> tuple[Node, int] | None:
    """(x, 0 or 1) when t is x[..., 0::2] / x[..., 1::2], or [..., 0] / [..., 1] of x viewed as (.., D/2, 2)."""
    t = strip(t)
    if op(t) == "slice" and is_last_dim(t.args[1], node_rank(t.args[0])) and len(t.args) >= 5 and t.args[4] == 2:
        return t.args[0], 0 if t.args[2] in (0, None) else 1
    if op(t) == "select" and is_last_dim(t.args[1], node_rank(t.args[0])) and t.args[2] in (0, 1):
        src = strip(t.args[0])
        if op(src) in ("view", "reshape", "unflatten", "_unsafe_view") and node_rank(src) == node_rank(src.args[0]) + 1:
            return src.args[0], t.args[2]
    return None


def _interleaved_stack_site(n: Node) -> Site | None:
    """flatten(stack([xe * c - xo * s, xe * s + xo * c], -1), -2) (the flatten as view / reshape)."""
    pair = _flat_pair_stack(n)
    if pair is None:
        return None
    sub, add = pair
    if op(sub) != "sub" or op(add) != "add":
        return None

    def term(t: Any) -> tuple[Node, int, Any] | None:
        parts = _mul_parts(t)
        if parts is None:
            return None
        for a, b in (parts, parts[::-1]):
            p = _pair_of(a)
            if p is not None:
                return p[0], p[1], b
        return None

    ts = [term(t) for t in (sub.args[0], sub.args[1], add.args[0], add.args[1])]
    if not all(ts) or len({id(strip(t[0])) for t in ts}) != 1:
        return None
    x = ts[0][0]
    if (ts[0][1], ts[1][1]) != (0, 1):
        return None
    cos, sin = ts[0][2], ts[1][2]
    last = _out_node(n)
    params = {"style": "interleaved", "dup_halves": False, "half_width": True, "out_dtype": _dt(last)}
    return _site(Kind.rope, last, {"x": x, "cos": cos, "sin": sin}, params)


def _pairs_view(src: Node, n: Node) -> bool:
    """src views its input x [.., D] as [.., D/2, 2] and n flattens the rotated pairs back to x's shape
    (the kernels write the output in x's layout)."""
    xs, ps, ns = node_shape(src.args[0]), node_shape(src), node_shape(n)
    if xs is None or ps is None or ns is None or not xs:
        return False
    try:
        return bool(ns == xs and ps == (*xs[:-1], xs[-1] // 2, 2))  # an odd D has no such view
    except Exception:  # noqa: BLE001 - a symbolic size the trace cannot decide: not provably the pairs view
        return False


def _interleaved_complex_site(n: Node) -> Site | None:
    """flatten(view_as_real(view_as_complex(x.reshape(.., D/2, 2)) * freqs_cis))."""
    if op(n) not in ("flatten", "view", "reshape", "_unsafe_view"):
        return None
    vr = strip(n.args[0])
    if op(vr) != "view_as_real" or op(vr.args[0]) != "mul":
        return None
    a, b = vr.args[0].args[:2]
    if node_dtype(vr.args[0]) != torch.complex64:  # the kernels' fp32 maths (complex128 would lose precision there)
        return None
    for xc, f in ((a, b), (b, a)):
        # freqs complex too (a real multiplier has no imaginary part to read); x viewed as pairs with no cast between
        # (a cast after the reshape would make the kernels read x at its lower precision)
        if op(xc) == "view_as_complex" and node_dtype(f) == torch.complex64:
            src = xc.args[0]
            if op(src) in ("view", "reshape", "_unsafe_view", "unflatten") and _pairs_view(src, n):
                last = _out_node(n)
                params = {"style": "interleaved_complex", "dup_halves": False, "half_width": True,
                          "out_dtype": _dt(last)}  # fmt: skip
                return _site(Kind.rope, last, {"x": src.args[0], "freqs": f}, params)
    return None


def rope_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    covered: set[Node] = set()
    for n in gm.graph.nodes:
        if n in taken or n in covered:
            continue
        site = None
        if op(n) == "add" and len(n.args) >= 2 and all(isinstance(a, Node) for a in n.args[:2]):
            site = _rotate_half_site(n)
        elif op(n) == "cat" and len(n.args[0]) == 2 and is_last_dim(arg(n, 1, "dim", 0), node_rank(n)):
            site = _split_halves_site(n)
        elif op(n) in ("flatten", "view", "reshape", "_unsafe_view"):
            site = _interleaved_stack_site(n) or _interleaved_complex_site(n)
        if site is not None and not (site.nodes & (taken | covered)):
            out.append(site)
            covered |= site.nodes
    return out


__all__ = ["dup_halves", "dup_pairs", "rope_sites"]
