"""Sort sites: the stable sort of integer keys known to lie in [0, E), with their histogram, as one counting sort.

MoE routing groups token-expert assignments by expert: a stable ``sort`` / ``argsort`` of the expert ids gives the
permutation, ``bincount(ids, minlength=E)`` (and its ``cumsum``) each expert's segment (L1/058). A site takes:

* a stable ascending sort (``sort(stable=True)``, ``argsort(stable=True)``) of a 1-D int32 / int64 tensor: its
  permutation and, where read, the sorted keys;
* a ``bincount`` without weights of the same values (through views and widening casts), with the ``cumsum`` that
  reads it where that is its only reader; or such a ``bincount`` alone.

Only where the keys are provably in [0, E): the ``bincount``'s length is pinned at ``minlength`` = E by the graph
itself (``kernelarc.graph.capture.bincount_pinned``: the reference runs only when every key is below E), or the keys
are ``topk`` indices along a dimension of size E (``index_source``). Served by ``counting_sort.blocked``
(``kernelarc.families.sorting``): two launches and no host sync, where eager PyTorch runs a radix sort over all 32 key
bits and ``bincount`` reads the keys' minimum and maximum on the host."""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import (
    _is_bincount,
    bincount_bins,
    bincount_pinned,
    index_source,
    node_dtype,
    node_shape,
    static_int,
    value_root,
)
from kernelarc.graph.patterns import Kind, Site, arg, mutation_between, op

KEY_DTYPES = (torch.int32, torch.int64)
MAX_BINS = 4096  # bins the kernel holds (its histogram in shared memory, a few vectors of bins per program)
ROLES = ("perm", "values", "counts", "offsets")  # the site's outputs, in the kernel's order


def _stable_sort(n: Node) -> Node | None:
    """The keys of a stable ascending sort of a whole 1-D integer tensor (``sort`` / ``argsort``), else None."""
    name = op(n)
    if name not in ("sort", "argsort") or "stable" not in str(n.target._overloadname):
        return None
    if not n.kwargs.get("stable", False) or n.kwargs.get("descending", False) or n.kwargs.get("dim", -1) not in (0, -1):
        return None
    keys = n.args[0]
    v = keys.meta.get("val") if isinstance(keys, Node) else None
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype not in KEY_DTYPES:
        return None
    return keys


def _items(n: Node) -> dict[int, Node]:
    """The ``getitem`` readers of a sort node's (values, indices) pair, by index."""
    return {u.args[1]: u for u in n.users if u.op == "call_function" and u.target is operator.getitem}


def _counts(b: Node, covered: set[Node]) -> tuple[Node, Node | None]:
    """The bincount's value read outside the site and its ``cumsum`` where that is the bincount's only reader."""
    users = list(b.users)
    if len(users) == 1 and op(users[0]) == "cumsum" and arg(users[0], 1, "dim") in (0, -1) \
            and users[0].kwargs.get("dtype") is None:  # fmt: skip
        covered.add(users[0])
        return users[0], users[0]
    return b, None


def _site_for(sort: Node | None, b: Node | None, taken: set[Node]) -> Site | None:
    covered: set[Node] = set()
    outs: dict[str, Node] = {}
    if sort is not None:
        keys = _stable_sort(sort)
        covered.add(sort)
        if op(sort) == "argsort":
            outs["perm"] = sort
        else:
            items = _items(sort)
            if len(items) != len(sort.users) or 1 not in items:
                return None  # the pair read whole, or only its values: not a permutation the kernel writes alone
            covered |= set(items.values())
            outs["perm"] = items[1]
            if 0 in items and items[0].users:
                outs["values"] = items[0]
    else:
        assert b is not None
        keys = b.args[0]
    v = keys.meta.get("val") if isinstance(keys, Node) else None
    if not isinstance(v, torch.Tensor) or v.dim() != 1 or v.dtype not in KEY_DTYPES:
        return None
    bins: int | None = None
    inputs: dict[str, Any] = {"keys": keys}
    if b is not None:
        covered.add(b)
        src, root = b.args[0], value_root(keys)
        # the casts and views bincount reads the keys through, where nothing else reads them: the kernel reads the
        # keys as they are, and those nodes would be dead work
        while src is not keys and src is not root and isinstance(src, Node) and len(src.users) == 1 \
                and value_root(src) is root and src.args:  # fmt: skip
            covered.add(src)
            src = src.args[0]
        node, offs = _counts(b, covered)
        outs["offsets" if offs is not None else "counts"] = node
        bins = bincount_bins(b)
    src = index_source(keys)
    if bins is None and src is not None:
        size = node_shape(src[0])[src[1]]
        bins = static_int(size)
        if bins is None and isinstance(size, torch.SymInt) and size.node.has_hint():
            # a symbolic size: the kernel reads it from that tensor when it runs (the traced example's for show)
            inputs["bins_of"], bins = src[0], int(size.node.hint)
    if bins is None or not 1 <= bins <= MAX_BINS or covered & taken:
        return None
    order = {n: i for i, n in enumerate(keys.graph.nodes)}
    last = max(outs.values(), key=order.__getitem__)
    # the site runs at its last output: a write in place before that (into the keys or a view of them) would be
    # read by the kernel where the reference's sort read the keys as they were
    if mutation_between(min(covered, key=order.__getitem__), last, covered):
        return None
    for n in covered:  # what the site computes is read outside it only through its outputs, after the last one
        for u in n.users:
            if u not in covered and (n not in outs.values() or order[u] < order[last]):
                return None
    extra = {role: node for role, node in outs.items() if node is not last}
    params = {"bins": bins, "dtype": str(node_dtype(keys)).removeprefix("torch."), "bins_dim": src[1] if src else None,
              **{role: role in outs for role in ROLES}, "_roles": {role: outs[role] for role in outs}}  # fmt: skip
    return Site(Kind.counting_sort, last, covered, inputs, params, extra)


def sort_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    seen = set(taken)
    counts = [n for n in gm.graph.nodes if _is_bincount(n) and n.args[1] is None and bincount_pinned(n)]
    for n in gm.graph.nodes:
        keys = _stable_sort(n) if n not in seen else None
        if keys is None:
            continue
        root = value_root(keys)
        b = next((c for c in counts if c not in seen and value_root(c.args[0]) is root), None)
        site = _site_for(n, b, seen) if b is not None else None
        if site is None:  # the sort alone, where its keys' bound holds without the histogram (topk indices)
            site = _site_for(n, None, seen)
        if site is not None:
            out.append(site)
            seen |= site.nodes
    for b in counts:  # histograms no sort reads the keys of
        if b not in seen and (site := _site_for(None, b, seen)) is not None:
            out.append(site)
            seen |= site.nodes
    return out


def describe_roles(site: Site) -> list[tuple[str, Any]]:
    """(role, graph node) of the site's outputs in the kernel's order."""
    return [(r, site.params["_roles"][r]) for r in ROLES if r in site.params["_roles"]]


__all__ = ["ROLES", "describe_roles", "sort_sites"]
