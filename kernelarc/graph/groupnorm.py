"""GroupNorm sites: ``group_norm(x, G, weight, bias, eps)`` over ``x`` [B, C, ...] (a VAE / UNet block's norm), or the
same written out (a view to [B, G, C // G, ...], mean and population variance over the group's axes, a view back,
the per-channel affine: L1/089's attention block opens with one), with the SiLU that follows it and the residual
add after that where each is the previous op's only reader (L1/002: conv -> GroupNorm -> SiLU -> conv -> GroupNorm
-> SiLU -> + x). Served by
``group_norm.split`` (``kernelarc.families.groupnorm``): one pass for each group's statistics and one that
normalises, applies the affine, the SiLU and the residual, and stores once, where eager PyTorch runs the norm, the
activation and the add as three kernels over the whole tensor."""

from __future__ import annotations

from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import node_dtype, node_shape, static_int
from kernelarc.graph.patterns import Kind, Site, _biased, _site, arg, op

_FLOATS = {torch.float32, torch.bfloat16, torch.float16}


def _only_user(n: Node, taken: set[Node], *ops: str) -> Node | None:
    users = list(n.users)
    return users[0] if len(users) == 1 and users[0] not in taken and op(users[0]) in ops else None


def _other(binary: Node, operand: Node) -> Any:
    """The operand of a two-operand op that is not ``operand``."""
    return binary.args[1] if binary.args[0] is operand else binary.args[0]


_VIEWS = {"view", "reshape", "_unsafe_view"}


def _population_var(v: Node) -> bool:
    """``var`` without Bessel's correction (LayerNorm's ``_biased``), keepdim."""
    keep = v.args[3] if len(v.args) > 3 else v.kwargs.get("keepdim", False)
    return op(v) == "var" and _biased(v) and bool(keep)


def _channel_vector(n: Any, channels: Any, rank: int) -> Node | None:
    """The 1-D [C] tensor ``n`` is a view of, broadcast along the channel axis of a rank-``rank`` [B, C, ...] value:
    ``w.view(1, C, 1, 1)`` or ``w.view(C, 1, 1)``."""
    if op(n) not in _VIEWS or not isinstance(n.args[0], Node) or node_shape(n.args[0]) is None:
        return None
    base, shape = n.args[0], node_shape(n)
    if len(node_shape(base)) != 1 or node_shape(base)[0] != channels or shape is None:
        return None
    if tuple(shape) not in ((1, channels, *[1] * (rank - 2)), (channels, *[1] * (rank - 2))):
        return None
    return base


def _manual(view_back: Node) -> tuple[Node, int, float] | None:
    """(x, groups, eps) where ``view_back`` is a GroupNorm written out: ``v = x.view(B, G, C // G, ...)``, then
    ``(v - v.mean(dims, keepdim)) / sqrt(v.var(dims, unbiased=False, keepdim) + eps)`` (or times ``rsqrt``) over
    every axis after the group's, viewed back to ``x``'s shape."""
    if op(view_back) not in _VIEWS or not isinstance(view_back.args[0], Node):
        return None
    norm = view_back.args[0]
    if op(norm) == "div":
        centred, den = norm.args
        if op(den) != "sqrt":
            return None
        var_eps = den.args[0]
    elif op(norm) == "mul":
        centred, den = norm.args
        if op(den) != "rsqrt":
            centred, den = den, centred
        if op(den) != "rsqrt":
            return None
        var_eps = den.args[0]
    else:
        return None
    if op(centred) != "sub" or op(var_eps) != "add" or not isinstance(var_eps.args[1], float | int):
        return None
    v, mean = centred.args
    var = var_eps.args[0]
    if op(mean) != "mean" or mean.args[0] is not v or not isinstance(var, Node) or var.args[0] is not v:
        return None
    if not _population_var(var) or op(v) not in _VIEWS or not isinstance(v.args[0], Node):
        return None
    x = v.args[0]
    xs, vs = node_shape(x), node_shape(v)
    if xs is None or vs is None or len(vs) != len(xs) + 1 or node_shape(view_back) != xs:
        return None
    dims = list(range(2, len(vs)))
    for red in (mean, var):
        rd = red.args[1] if len(red.args) > 1 else red.kwargs.get("dim")
        if sorted(d % len(vs) for d in (rd if isinstance(rd, list | tuple) else [rd])) != dims:
            return None
    if op(mean) == "mean" and not (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False)):
        return None
    groups = static_int(vs[1])
    if groups is None or vs[0] != xs[0]:
        return None
    return x, groups, float(var_eps.args[1])


def group_norm_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        if n in taken:
            continue
        weight = bias = None
        if op(n) == "group_norm":
            x, groups = n.args[0], arg(n, 1, "num_groups")
            weight, bias, eps = arg(n, 2, "weight"), arg(n, 3, "bias"), arg(n, 4, "eps", 1e-5)
            last = n
        elif (found := _manual(n)) is not None:
            x, groups, eps = found
            last = n
            # the affine after it: times a [C] weight viewed [1, C, 1, ...], plus a bias viewed so
            channels, rank = node_shape(x)[1], len(node_shape(x))
            mul = _only_user(last, taken, "mul")
            if mul is not None:
                w = _channel_vector(_other(mul, last), channels, rank)
                if w is not None:
                    weight, last = w, mul
                    add = _only_user(last, taken, "add")
                    if add is not None:
                        b = _channel_vector(_other(add, last), channels, rank)
                        if b is not None:
                            bias, last = b, add
        else:
            continue
        shape, dtype = node_shape(x), node_dtype(last)
        if not isinstance(x, Node) or not isinstance(groups, int) or groups < 1 or not isinstance(eps, float | int):
            continue
        if shape is None or len(shape) < 3 or dtype not in _FLOATS or node_dtype(x) != dtype:
            continue
        if any(w is not None and not isinstance(w, Node) for w in (weight, bias)):
            continue
        act, residual = "none", None
        silu = _only_user(last, taken, "silu")
        if silu is not None and node_dtype(silu) == dtype:
            last, act = silu, "silu"
        add = _only_user(last, taken, "add")
        if add is not None and len(add.args) == 2 and add.kwargs.get("alpha", 1) == 1 and node_dtype(add) == dtype:
            other = _other(add, last)
            if isinstance(other, Node) and node_shape(other) == node_shape(last) and node_dtype(other) == dtype:
                last, residual = add, other
        inputs: dict[str, Any] = {"x": x, "weight": weight, "bias": bias}
        if residual is not None:
            inputs["residual"] = residual
        form = "aten" if op(n) == "group_norm" else "manual"
        params = {"groups": groups, "eps": float(eps), "act": act, "residual": residual is not None,
                  "dtype": str(dtype).removeprefix("torch."), "form": form}  # fmt: skip
        site = _site(Kind.group_norm, last, inputs, params)
        if site is not None:
            out.append(site)
    return out


__all__ = ["group_norm_sites"]
