"""Scatter-add sites: ``base.index_add_(0, index, source)`` into a fresh buffer (a clone of a tensor, or zeros),
with the cast that follows it where it is the buffer's only reader, and the same sum written as ``index_put_`` with
``accumulate=True`` or as ``scatter_add_`` with a row index broadcast over the rows. An MoE combine (L1/008: the
experts' weighted outputs added back at their tokens' rows) and an embedding backward (L1/087: token gradients added
into a vocabulary-sized fp32 buffer, then written out in bf16) end so. Served by ``scatter_add.sorted``
(``kernelarc.families.scatter``), which writes every output row once, cast included."""

from __future__ import annotations

from typing import Any

import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import node_dtype, node_rank, node_shape
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


_VIEWS_TO_COLUMN = {"unsqueeze", "view", "reshape", "_unsafe_view"}


def _row_index(index: Any, source: Any) -> Node | None:
    """The 1-D row index a ``scatter_add`` index broadcasts over the trailing dims (``idx.view(-1, 1).expand_as(src)``,
    ``idx.unsqueeze(-1).expand(-1, H)``); None for an index that varies along them."""
    if op(index) not in ("expand", "expand_as") or node_shape(index) != node_shape(source):
        return None
    col = index.args[0]
    shape = node_shape(col)
    if op(col) not in _VIEWS_TO_COLUMN or shape is None or any(d != 1 for d in shape[1:]):
        return None
    row = col.args[0]
    return row if isinstance(row, Node) and node_rank(row) == 1 else None


def _match(n: Node) -> tuple[Node, Node, Node] | None:
    """(buffer, 1-D row index, source rows) of a row scatter-add along dim 0: ``index_add(_)``, ``index_put(_)``
    with ``accumulate=True`` and one index tensor, ``scatter_add(_)`` with a row index broadcast over the rows."""
    o = op(n)
    if o in ("index_add_", "index_add") and len(n.args) >= 4:
        base, dim, index, source = n.args[:4]
        if n.kwargs.get("alpha", n.args[4] if len(n.args) > 4 else 1) != 1:
            return None
    elif o in ("index_put_", "index_put") and len(n.args) >= 3:
        base, indices, source = n.args[:3]
        if not (n.args[3] if len(n.args) > 3 else n.kwargs.get("accumulate", False)):
            return None  # without accumulate, duplicate indices keep one value: not a sum
        if not isinstance(indices, list | tuple) or len(indices) != 1:
            return None
        dim, index = 0, indices[0]
    elif o in ("scatter_add_", "scatter_add") and len(n.args) >= 4:
        base, dim, index2d, source = n.args[:4]
        index = _row_index(index2d, source)
    else:
        return None
    if not all(isinstance(x, Node) for x in (base, index, source)):
        return None
    rank = node_rank(base)
    if rank is None or rank < 1 or dim not in (0, -rank) or node_rank(index) != 1 or node_rank(source) != rank:
        return None
    return base, index, source


def scatter_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        found = None if n in taken else _match(n)
        if found is None:
            continue
        base, index, source = found
        index_val = index.meta.get("val")
        if getattr(index_val, "dtype", None) not in _INDEX_DTYPES:
            continue
        inplace = str(op(n)).endswith("_")
        if inplace and len(base.users) != 1:
            continue  # an in-place add: the buffer must be read only through it
        bo = op(base) if len(base.users) == 1 else None  # a buffer read elsewhere too is the base as it is
        inputs: dict[str, Any] = {"index": index, "source": source}
        if bo == "clone" and isinstance(base.args[0], Node):
            inputs["base"] = base.args[0]
        elif not inplace and bo not in _ZEROS:  # out of place (torch.scatter_add(x, ...)): x is read, not written
            inputs["base"] = base
        elif bo in _ZEROS:
            if bo == "zeros_like":  # its rows are those of the tensor it copies the shape of
                inputs["like"] = base.args[0]
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
        # index_put_ reads a negative index from the end, as Python indexing does; index_add_ and scatter_add_
        # refuse one (a device-side assert), and the kernel drops it
        params = {"zero": "base" not in inputs, "dtype": str(node_dtype(n)).replace("torch.", ""),
                  "out_dtype": str(node_dtype(last)).replace("torch.", ""),
                  "wrap": str(op(n)).startswith("index_put"),
                  "like_rows": "like" in inputs and "rows" not in inputs}  # fmt: skip
        site = _site(Kind.scatter_add, last, inputs, params)
        if site is None and last is not n:  # the cast read elsewhere too: the scatter alone
            params["out_dtype"] = params["dtype"]
            site = _site(Kind.scatter_add, n, inputs, params)
        if site is not None:
            out.append(site)
    return out


__all__ = ["scatter_sites"]
