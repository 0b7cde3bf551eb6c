"""Scaled fp8 GEMMs: ``dequant(qa, sa) @ dequant(qb, sb).T``, the dequantise-then-matmul form of a
blockwise / per-row / per-tensor scaled fp8 matrix product, recognised by structure.

A dequantised operand is an ``float8_e4m3fn`` tensor ``q`` [R, C] cast up and multiplied by its
scales ``s``, in one of the forms the scaling recipes (``torch._scaled_mm``'s, SOL-ExecBench's
``ScalingType``) write:

* blockwise: ``(q.to(f32).reshape(R / bm, bm, C / bk, bk) * s[:, None, :, None]).reshape(R, C)`` with
  ``s`` [R / bm, C / bk] (the unsqueezes may be any view that puts 1s at dims 1 and 3);
* per-row: ``q.to(f32) * s`` with ``s`` [R, 1] (``s[:, None]`` of an [R] vector);
* per-tensor: ``q.to(f32) * s`` with a one-element ``s``.

The product is ``matmul`` / ``mm`` of the dequantised A [M, K] and the transpose of the dequantised
B [N, K] (weight layout), optionally followed by a rank-1 bias add and a cast (the output dtype).
The block sizes are read from the graph (the reshape's literal sizes); the adapter checks the
shapes at run time and falls back to the site's own ops for anything the family does not cover.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import node_dtype, node_rank, node_shape
from kernelarc.graph.patterns import Kind, Site, _site, _transposed_last, only_user, op, scalar

FP8_DTYPES = (torch.float8_e4m3fn,)  # what the fp8 GEMM families read
_RESHAPES = ("reshape", "view", "_unsafe_view")
_VIEWS = ("unsqueeze", "view", "reshape", "_unsafe_view", "expand")
_UP = ("to", "_to_copy")


def _cast_of_fp8(x: Any) -> Node | None:
    """q when ``x`` is ``q.to(float32)`` (or bf16 / fp16) of an e4m3 tensor."""
    if op(x) not in _UP or not isinstance(x.args[0], Node):
        return None
    if any(isinstance(a, torch.device) for a in [*x.args[1:], *x.kwargs.values()]):
        return None
    q = x.args[0]
    if node_dtype(q) not in FP8_DTYPES or node_dtype(x) not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    return q


def _view_source(x: Any, rank: int) -> Node | None:
    """The node of rank ``rank`` that ``x`` is a chain of views of (unsqueeze, view, reshape)."""
    while isinstance(x, Node) and node_rank(x) != rank:
        if op(x) not in _VIEWS or not isinstance(x.args[0], Node):
            return None
        x = x.args[0]
    return x if isinstance(x, Node) else None


def _ones_at(shape: tuple | None, dims: tuple[int, ...]) -> bool:
    return shape is not None and all(str(shape[d]) == "1" for d in dims)


def dequant_of(d: Any) -> tuple[Node, Node, dict[str, Any], list[Any]] | None:
    """(q, s, scaling, shape_args) when ``d`` dequantises the fp8 tensor q [R, C] with scales s.

    ``scaling`` is ``{"mode": "block", "block": (bm, bk)}``, ``{"mode": "row"}`` or ``{"mode": "tensor"}``;
    ``shape_args`` the sizes a blockwise form reshapes back to (checked against q's shape at run time)."""
    if op(d) in _RESHAPES and op(d.args[0]) == "mul" and node_rank(d) == 2:
        m = d.args[0]
        back = list(d.args[1]) if isinstance(d.args[1], list | tuple) else None
        for x4, s4 in ((m.args[0], m.args[1]), (m.args[1], m.args[0])):
            if op(x4) not in _RESHAPES or node_rank(x4) != 4 or node_rank(s4) != 4:
                continue
            sizes = x4.args[1]
            if not isinstance(sizes, list | tuple) or len(sizes) != 4:
                continue
            bm, bk = sizes[1], sizes[3]
            q = _cast_of_fp8(x4.args[0])
            if q is None or node_rank(q) != 2 or not isinstance(bm, int) or not isinstance(bk, int):
                continue
            if not _ones_at(node_shape(s4), (1, 3)):
                continue
            s = _view_source(s4, 2)
            if s is None or back is None or len(back) != 2:
                continue
            return q, s, {"mode": "block", "block": (bm, bk)}, back
        return None
    if op(d) == "mul" and node_rank(d) == 2 and len(d.args) == 2:
        for x, s in ((d.args[0], d.args[1]), (d.args[1], d.args[0])):
            q = _cast_of_fp8(x)
            if q is None or node_rank(q) != 2 or not isinstance(s, Node):
                continue
            shape = node_shape(s)
            if shape is None or node_dtype(s) is None or not node_dtype(s).is_floating_point:
                continue
            if all(str(a) == "1" for a in shape):
                return q, s, {"mode": "tensor"}, []
            if len(shape) == 2 and str(shape[1]) == "1" and str(shape[0]) == str(node_shape(q)[0]):
                return q, s, {"mode": "row"}, []
    return None


def _fp8_mode(sa: dict[str, Any], sb: dict[str, Any], block: int) -> str | None:
    """How the fp8 GEMM families read these scalings: 'block' (1 x block / block x block), 'outer'
    (per-row or per-tensor on each side), None when they cannot."""
    if sa["mode"] == sb["mode"] == "block":
        return "block" if sa["block"] == (1, block) and sb["block"] == (block, block) else None
    if sa["mode"] in ("row", "tensor") and sb["mode"] in ("row", "tensor"):
        return "outer"
    return None


SCALE_BLOCK = 128  # the fp8 families' (and the recipes') block edge


def requantised(n: Node) -> bool:
    """Whether a value computed from ``n`` is cast to e4m3 further down the graph (an activation the
    reference quantises again for the next fp8 GEMM, as an MoE expert's gate-up feeds its down
    projection). Such a cast turns a product's sub-ulp differences into whole fp8 steps and moved block
    scales, so the site needs the reference's fp32 sums, not the fp8 tensor cores' 13-bit ones."""
    seen: set[Node] = set()
    todo = list(n.users)
    while todo:
        u = todo.pop()
        if u in seen:
            continue
        seen.add(u)
        if op(u) in _UP and node_dtype(u) in FP8_DTYPES:
            return True
        todo.extend(u.users)
    return False


def fp8_gemm_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        if n in taken or op(n) not in ("matmul", "mm") or node_rank(n) != 2:
            continue
        bt = _transposed_last(n.args[1])
        if bt is None or node_rank(n.args[0]) != 2:
            continue
        da, db = dequant_of(n.args[0]), dequant_of(bt)
        if da is None or db is None:
            continue
        mode = _fp8_mode(da[2], db[2], SCALE_BLOCK)
        if mode is None:
            continue
        last, bias = n, None
        u = only_user(last)
        if op(u) == "add" and len(u.args) == 2 and scalar(u.kwargs.get("alpha", 1)) == 1.0:  # alpha literally 1
            other = u.args[1] if u.args[0] is last else u.args[0]
            if isinstance(other, Node) and node_rank(other) == 1:
                bias, last = other, u
                u = only_user(last)
        if op(u) in ("to", "_to_copy") and not u.kwargs.get("device") and node_dtype(u) is not None:
            last = u
        qa, sa, _, back_a = da
        qb, sb, _, back_b = db
        inputs: dict[str, Any] = {"qa": qa, "sa": sa, "qb": qb, "sb": sb}
        if bias is not None:
            inputs["bias"] = bias
        # the blockwise forms' reshape-back sizes (graph values outside the site, or ints)
        for role, back in (("a", back_a), ("b", back_b)):
            for i, v in enumerate(back):
                if isinstance(v, Node):
                    inputs[f"back_{role}{i}"] = v
        params = {
            "mode": mode,
            "scaling_a": da[2]["mode"],
            "scaling_b": db[2]["mode"],
            "bias": bias is not None,
            "back_a": [v if not isinstance(v, Node) else f"back_a{i}" for i, v in enumerate(back_a)],
            "back_b": [v if not isinstance(v, Node) else f"back_b{i}" for i, v in enumerate(back_b)],
            "acc_dtype": str(node_dtype(n)).replace("torch.", ""),
            "out_dtype": str(node_dtype(last)).replace("torch.", ""),
            "requant": requantised(last),
        }
        site = _site(Kind.fp8_gemm, last, inputs, params)
        if site is not None:
            site.params["core"] = n.name
            out.append(site)
    return out


__all__ = ["FP8_DTYPES", "SCALE_BLOCK", "dequant_of", "fp8_gemm_sites", "requantised"]
