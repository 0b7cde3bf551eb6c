"""Variable-length (packed) attention: one attention per segment of a packed sequence, the segments
given by cumulative offsets (``cu_seqlens``) the reference reads on the host.

Capture bakes such an input into the graph (``GraphCase.baked``: its placeholder has no users and
carries ``meta["baked"]``, the values traced), so the graph holds one attention per non-empty segment,
each over ``slice(Q, dim, cu[i], cu[i + 1])`` (and the same of K and V), their outputs (through the
same view ops) concatenated along the packed dim. Recognised as one attention site of style
``varlen``: its inputs are the whole Q, K, V and the offsets' placeholder, and its implementation
loops over the offsets at run time, so the composed candidate is right for any offsets.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.patterns import Kind, Site, _site, op, strip

# ops a segment's output passes through before the concatenation (no data changes)
_CHAIN_OPS = {"transpose", "permute", "reshape", "view", "unsqueeze", "squeeze", "contiguous", "to", "_to_copy"}
_INT_MAX = 2**63 - 1


def _segment(n: Any) -> tuple[Node, int, int, int] | None:
    """(base, dim, start, end) when ``n`` is base[..., start:end, ...] along one dim with constant bounds."""
    n = strip(n)
    if n.op == "call_function" and n.target is operator.getitem and op(n.args[0]) in ("split_with_sizes", "split"):
        # torch.split(Q, lengths.tolist(), dim)[i]
        src, i = n.args[0], n.args[1]
        base, sizes = src.args[0], src.args[1]
        dim = src.args[2] if len(src.args) > 2 else src.kwargs.get("dim", 0)
        if not (isinstance(base, Node) and isinstance(sizes, list | tuple) and isinstance(i, int)):
            return None
        if not all(isinstance(z, int) for z in sizes) or not isinstance(dim, int):
            return None
        rank = base.meta["val"].dim() if isinstance(base.meta.get("val"), torch.Tensor) else None
        if rank is None:
            return None
        start = sum(sizes[:i])
        return base, dim % rank, start, start + sizes[i]
    if op(n) != "slice" or len(n.args) < 4 or (len(n.args) > 4 and n.args[4] != 1):
        return None
    base, dim, start, end = n.args[:4]
    if not (isinstance(base, Node) and isinstance(dim, int) and isinstance(start, int) and isinstance(end, int)):
        return None
    rank = base.meta["val"].dim() if isinstance(base.meta.get("val"), torch.Tensor) else None
    if rank is None:
        return None
    size = base.meta["val"].shape[dim]
    return base, dim % rank, start, min(end, int(size)) if end == _INT_MAX else end


def _chain(out: Node) -> tuple[list[tuple[Any, tuple]], Node, Node] | None:
    """The view ops from a segment's attention output to the concatenation: (ops, last node, cat)."""
    ops: list[tuple[Any, tuple]] = []
    cur = out
    for _ in range(6):
        users = list(cur.users)
        if len(users) != 1:
            return None
        u = users[0]
        if op(u) == "cat":
            return ops, cur, u
        if op(u) not in _CHAIN_OPS or u.args[0] is not cur or u.kwargs.get("device"):
            return None
        if any(isinstance(a, Node) for a in u.args[1:]) or any(isinstance(v, Node) for v in u.kwargs.values()):
            return None
        ops.append((u.target, tuple(u.args[1:]), dict(u.kwargs)))
        cur = u
    return None


def _same_attention(a: Site, b: Site) -> bool:
    keys = ("causal", "gqa", "scale", "dropout", "mask", "in_dtype", "q_src_dtype", "style")
    return all(a.params.get(k) == b.params.get(k) for k in keys)


def varlen_sites(gm: torch.fx.GraphModule, attention: list[Site]) -> list[Site]:
    """Per-segment attention sites over baked offsets, merged into one ``varlen`` site per packed group."""
    baked = [(n, n.meta["baked"]) for n in gm.graph.nodes if n.op == "placeholder" and "baked" in n.meta]
    if not baked:
        return []
    groups: dict[tuple, list[tuple[int, int, Site]]] = {}
    for s in attention:
        if s.params.get("mask") != "none" or s.params.get("scale_ops") or s.params.get("gqa"):
            continue
        segs = [_segment(s.inputs[r]) for r in ("q", "k", "v")]
        if any(g is None for g in segs):
            continue
        (qb, qd, qs, qe), (kb, kd, ks, ke), (vb, vd, vs, ve) = segs  # type: ignore[misc]
        if not (qd == kd == vd and (qs, qe) == (ks, ke) == (vs, ve)):
            continue
        groups.setdefault((qb, kb, vb, qd), []).append((qs, qe, s))
    out: list[Site] = []
    for (qb, kb, vb, dim), segs in groups.items():
        for ph, vals in baked:
            if not isinstance(vals, list) or len(vals) < 2 or not all(isinstance(v, int) for v in vals):
                continue
            pairs = [(a, b) for a, b in zip(vals, vals[1:], strict=False) if b > a]
            if [(a, b) for a, b, _ in segs if b > a] != pairs:  # an empty segment's attention adds nothing
                continue
            site = _merge(qb, kb, vb, dim, ph, [s for _, _, s in segs])
            if site is not None:
                out.append(site)
            break
    return out


def _merge(qb: Node, kb: Node, vb: Node, dim: int, ph: Node, segs: list[Site]) -> Site | None:
    chains = [_chain(s.output) for s in segs]
    if any(c is None for c in chains) or not all(_same_attention(segs[0], s) for s in segs):
        return None
    cat = chains[0][2]  # type: ignore[index]
    if any(c[2] is not cat or c[0] != chains[0][0] for c in chains):  # type: ignore[index]
        return None
    if list(cat.args[0]) != [c[1] for c in chains]:  # type: ignore[index]
        return None
    cat_dim = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    params = {**segs[0].params, "style": "varlen", "seq_dim": dim, "cat_dim": cat_dim,
              "chain": chains[0][0], "segments": len(segs)}  # type: ignore[index]  # fmt: skip
    return _site(Kind.attention, cat, {"q": qb, "k": kb, "v": vb, "cu": ph, "mask": None}, params)


__all__ = ["varlen_sites"]
