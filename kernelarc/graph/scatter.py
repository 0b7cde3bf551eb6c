"""Scatter-add sites: ``base.index_add_(0, index, source)`` into a fresh buffer (a clone of a tensor, or zeros),
with the cast that follows it where it is the buffer's only reader. An MoE combine (L1/008: the experts' weighted
outputs added back at their tokens' rows) and an embedding backward (L1/087: token gradients added into a
vocabulary-sized fp32 buffer, then written out in bf16) end so. Served by ``scatter_add.sorted``
(``kernelarc.families.scatter``), which writes every output row once, cast included."""

from __future__ import annotations

from typing import Any

import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import node_dtype, node_rank
from kernelarc.graph.patterns import Kind, Site, _site, op

_ZEROS = {"zeros", "new_zeros", "zeros_like"}
_CASTS = {"to", "_to_copy"}
_INDEX_DTYPES = {torch.int64, torch.int32}


def _rows(base: Node) -> Any | None:
    """The zero buffer's row count as a graph value (an int or a size node); None where it is not written out."""
    o = op(base)
    if o == "zeros":
        size = base.args[0] if base.args else base.kwargs.get("size")
    elif o == "new_zeros":
        size = base.args[1] if len(base.args) > 1 else base.kwargs.get("size")
    else:
        return None
    return size[0] if isinstance(size, list | tuple) and size else None


def _cast_only(n: Node) -> bool:
    """``n`` changes the dtype only (no device, layout or memory-format change asked for)."""
    if op(n) not in _CASTS or not isinstance(n.args[0], Node):
        return False
    extra = {k for k in n.kwargs if k not in ("dtype", "copy", "non_blocking")}
    return not extra and node_dtype(n) is not None


def scatter_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        if n in taken or op(n) not in ("index_add_", "index_add") or len(n.args) < 4:
            continue
        base, dim, index, source = n.args[:4]
        alpha = n.kwargs.get("alpha", n.args[4] if len(n.args) > 4 else 1)
        rank = node_rank(base)
        if alpha != 1 or not all(isinstance(x, Node) for x in (base, index, source)) or rank is None or rank < 1:
            continue
        if dim not in (0, -rank) or node_rank(index) != 1 or node_rank(source) != rank:
            continue
        index_val = index.meta.get("val")
        if getattr(index_val, "dtype", None) not in _INDEX_DTYPES or len(base.users) != 1:
            continue  # the buffer must be read only through the scatter (an in-place add into it)
        bo = op(base)
        inputs: dict[str, Any] = {"index": index, "source": source}
        if bo == "clone" and isinstance(base.args[0], Node):
            inputs["base"] = base.args[0]
        elif bo in _ZEROS:
            if bo == "zeros_like":
                inputs["like"] = base.args[0]
                inputs["rows"] = None
            else:
                rows = _rows(base)
                if rows is None:
                    continue
                inputs["rows"] = rows
                if bo == "new_zeros":
                    inputs["like"] = base.args[0]
        else:
            continue
        last = n
        users = list(n.users)
        if len(users) == 1 and _cast_only(users[0]):
            last = users[0]
        params = {"zero": "base" not in inputs, "dtype": str(node_dtype(n)).replace("torch.", ""),
                  "out_dtype": str(node_dtype(last)).replace("torch.", "")}  # fmt: skip
        site = _site(Kind.scatter_add, last, {k: v for k, v in inputs.items() if v is not None}, params)
        if site is None and last is not n:  # the cast read elsewhere too: the scatter alone
            params["out_dtype"] = params["dtype"]
            site = _site(Kind.scatter_add, n, {k: v for k, v in inputs.items() if v is not None}, params)
        if site is not None:
            site.params["like_rows"] = "like" in inputs and inputs.get("rows") is None
            out.append(site)
    return out


__all__ = ["scatter_sites"]
