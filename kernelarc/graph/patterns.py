"""Recognise, by graph structure, the sub-graphs KernelArc's families and libraries solve.

Each recogniser walks the pre-dispatch aten graph of ``capture`` and returns ``Site`` values:
the kind of computation, the nodes it covers, the graph values that play each role of the
kernel interface (``inputs``), and the parameters the adapter needs (eps, activation, scale,
causal, layout). Names of inputs, dtypes and the author's style (functional, method calls,
manual maths) do not matter: dtype casts, ``contiguous`` and ``clone`` are looked through, and
manual forms (``x * rsqrt(mean(x**2) + eps) * w``, ``exp(x - max) / sum``,
``softmax(q @ k^T * s) @ v``) are matched next to the library ops (``rms_norm``, ``softmax``,
``scaled_dot_product_attention``).

A site is only reported when it is *replaceable*: no node inside it other than its outputs is
read from outside it, so the composition can drop the covered nodes.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import arg, node_dtype, node_rank, node_shape, op


class Kind(StrEnum):
    gemm = "gemm"
    fp8_gemm = "fp8_gemm"  # dequantise-then-matmul of scaled fp8 operands (``kernelarc.graph.quant``)
    attention = "attention"
    rmsnorm = "rmsnorm"
    add_rmsnorm = "add_rmsnorm"
    layernorm = "layernorm"
    dwconv = "dwconv"  # a depthwise conv1d with its channel slices and pointwise ops after it (kernelarc.graph.dwconv)
    group_norm = "group_norm"  # GroupNorm with the SiLU and the residual add after it (kernelarc.graph.groupnorm)
    softmax = "softmax"
    glu = "glu"
    rope = "rope"
    scatter_add = "scatter_add"  # index_add into a fresh buffer, its cast included (kernelarc.graph.scatter)
    counting_sort = "counting_sort"  # stable sort / histogram of keys in [0, E) (kernelarc.graph.sorting)
    fused = "fused"  # elementwise ops with row / column reductions as one generated kernel (kernelarc.graph.fusion)
    elementwise = "elementwise"
    reduction = "reduction"


@dataclass(eq=False)
class Site:
    kind: Kind
    output: Node  # the node whose value the site produces
    nodes: set[Node]  # nodes the site covers (output included)
    inputs: dict[str, Any]  # role -> graph value (Node) or constant
    params: dict[str, Any] = field(default_factory=dict)
    extra_outputs: dict[str, Node] = field(default_factory=dict)  # role -> covered node read outside the site

    def describe(self) -> str:
        shown = {k: v for k, v in self.params.items() if k != "users" and not k.startswith("_")}
        items = ", ".join(f"{k}={v}" for k, v in shown.items())
        return f"{self.kind.value}({items})" if items else self.kind.value


# ------------------------------------------------------------------------------------------
# node helpers

TRANSPARENT = {"to", "_to_copy", "contiguous", "clone", "detach", "alias", "type_as", "lift_fresh_copy"}
ACTIVATIONS = {"relu", "gelu", "silu", "sigmoid", "tanh", "leaky_relu", "elu", "hardswish", "mish"}
REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "var", "std", "prod", "linalg_vector_norm", "norm",
              "logsumexp", "argmax", "argmin", "cumsum", "any", "all"}  # fmt: skip


def mutates(n: Node) -> bool:
    """An op that writes one of its arguments (an aten overload whose schema is mutable: ``mul_``, ``copy_``...)."""
    schema = getattr(n.target, "_schema", None)
    return n.op == "call_function" and schema is not None and schema.is_mutable


def mutation_between(first: Node, last: Node, covered: set[Node]) -> bool:
    """An op outside a site (``covered``) between its first node and its last output writes in place: the site runs
    at its last output, so it would read its inputs after the write where the reference read them before
    (``u.mul_(2)``)."""
    between = False
    for n in first.graph.nodes:
        if n is first:
            between = True
        elif n is last:
            return False
        elif between and n not in covered and mutates(n):
            return True
    return False


def strip(x: Any) -> Any:
    """The value ``x`` is a cast / copy of (through dtype casts, contiguous, clone)."""
    while op(x) in TRANSPARENT and isinstance(x.args[0], Node):
        if op(x) == "to" and any(isinstance(a, torch.device) for a in list(x.args[1:]) + list(x.kwargs.values())):
            break
        x = x.args[0]
    return x


def chain_to(x: Any) -> list[Node]:
    """The transparent nodes from ``x`` back to strip(x) (x first)."""
    out = []
    while isinstance(x, Node) and x is not strip(x):
        out.append(x)
        x = x.args[0]
    return out


def scalar(x: Any) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, int | float):
        return float(x)
    return None


def is_last_dim(dim: Any, rank: int | None) -> bool:
    if isinstance(dim, list | tuple):
        if len(dim) != 1:
            return False
        dim = dim[0]
    return isinstance(dim, int) and rank is not None and (dim == -1 or dim == rank - 1)


def only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def same(a: Any, b: Any) -> bool:
    return isinstance(a, Node) and isinstance(b, Node) and strip(a) is strip(b)


def region(output: Node, stops: list[Any]) -> set[Node]:
    """Nodes from ``stops`` (excluded) up to ``output`` (included): ancestors of output not behind a stop."""
    stop = {s for s in stops if isinstance(s, Node)}
    seen: set[Node] = set()
    todo = [output]
    while todo:
        n = todo.pop()
        if n in seen or n in stop or n.op in ("placeholder", "get_attr", "output"):
            continue
        seen.add(n)
        for a in n.all_input_nodes:
            todo.append(a)
    return seen


def closed(nodes: set[Node], outputs: set[Node]) -> bool:
    """No covered node other than ``outputs`` is read outside the site."""
    for n in nodes:
        if n in outputs:
            continue
        if any(u not in nodes for u in n.users):
            return False
    return True


def _site(kind: Kind, output: Node, inputs: dict[str, Any], params: dict[str, Any],
          extra: dict[str, Node] | None = None) -> Site | None:  # fmt: skip
    nodes = region(output, list(inputs.values()))
    # size arithmetic (sym_size) read by nodes outside stays: drop such nodes from the cover
    nodes = {n for n in nodes if not _is_size_node(n)}
    extra = extra or {}
    if not closed(nodes, {output, *extra.values()}):
        return None
    return Site(kind, output, nodes, inputs, params, extra)


def _is_size_node(n: Node) -> bool:
    v = n.meta.get("val")
    return isinstance(v, torch.SymInt | torch.SymFloat | int | float) and not isinstance(v, torch.Tensor)


# ------------------------------------------------------------------------------------------
# RMSNorm (+ fused residual add)


def _mean_of_square(n: Node) -> Node | None:
    """x when ``n`` is mean(x*x or x**2, last dim, keepdim)."""
    if op(n) != "mean":
        return None
    src = n.args[0]
    rank = node_rank(src)
    if not is_last_dim(arg(n, 1, "dim"), rank) or not arg(n, 2, "keepdim", False):
        return None
    if op(src) == "pow" and scalar(src.args[1]) == 2.0:
        return src.args[0]
    if op(src) == "mul" and src.args[0] is src.args[1]:
        return src.args[0]
    if op(src) == "square":
        return src.args[0]
    return None


def _inv_rms(n: Node) -> tuple[Node, float] | None:
    """(x, eps) when ``n`` is 1/sqrt(mean(x^2) + eps) written as rsqrt, 1/sqrt or reciprocal(sqrt)."""
    inner = None
    if op(n) == "mul" and isinstance(n.args[0], Node) and scalar(n.args[1]) == 1.0:  # 1.0 / sqrt(v) traced
        return _inv_rms(n.args[0]) if op(n.args[0]) == "reciprocal" else None
    if op(n) == "rsqrt":
        inner = n.args[0]
    elif op(n) == "reciprocal" and op(n.args[0]) == "sqrt":
        inner = n.args[0].args[0]
    elif op(n) == "div" and scalar(n.args[0]) == 1.0 and op(n.args[1]) == "sqrt":
        inner = n.args[1].args[0]
    if inner is None:
        return None
    eps = 0.0
    if op(inner) == "add" and isinstance(inner.args[0], Node) and scalar(inner.args[1]) is not None:
        eps, inner = scalar(inner.args[1]), inner.args[0]
    x = _mean_of_square(inner)
    return (x, eps) if x is not None else None


def _norm_weight_mul(n: Node, x: Node) -> tuple[Node, Node] | None:
    """(weight, the mul node) for a user ``mul(n, w)`` / ``mul(w, n)`` with w of rank 1 over the last dim."""
    for u in n.users:
        if op(u) != "mul":
            continue
        other = u.args[1] if u.args[0] is n else u.args[0]
        if isinstance(other, Node) and node_rank(other) == 1:
            xs, ws = node_shape(x), node_shape(other)
            if xs and ws and str(xs[-1]) == str(ws[0]):
                return other, u
    return None


def _rmsnorm_sites(gm: torch.fx.GraphModule) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        if op(n) == "rms_norm":
            x, w, eps = n.args[0], arg(n, 2, "weight"), arg(n, 3, "eps")
            shape = arg(n, 1, "normalized_shape")
            if node_rank(x) and isinstance(shape, list | tuple) and len(shape) == 1 and isinstance(w, Node):
                eps = 1e-6 if eps is None else eps  # F.rms_norm's default is finfo.eps; real refs pass it
                site = _rms_site(n, x, w, float(eps), style="rms_norm")
                if site:
                    out.append(site)
            continue
        if op(n) == "div" and isinstance(n.args[0], Node) and op(n.args[1]) == "sqrt":
            # x / sqrt(mean(x^2) + eps), then * weight
            inner, eps = n.args[1].args[0], 0.0
            if op(inner) == "add" and isinstance(inner.args[0], Node) and scalar(inner.args[1]) is not None:
                eps, inner = scalar(inner.args[1]), inner.args[0]
            x = _mean_of_square(inner)
            if x is not None and (same(n.args[0], x) or n.args[0] is x):
                wm = _norm_weight_mul(n, x)
                site = _rms_site(wm[1], x, wm[0], eps, style="div_sqrt") if wm else None
                if site:
                    out.append(site)
            continue
        got = _inv_rms(n)
        if got is None:
            continue
        x, eps = got
        # x * inv (either order), then * weight
        for u in n.users:
            if op(u) != "mul" or not ({id(a) for a in u.args} >= {id(n)}):
                continue
            other = u.args[1] if u.args[0] is n else u.args[0]
            if not same(other, x) and other is not x:
                continue
            wm = _norm_weight_mul(u, x)
            if wm is None:
                continue
            w, last = wm
            site = _rms_site(last, x, w, eps, style="manual")
            if site:
                out.append(site)
    return out


def _rms_site(last: Node, x: Node, w: Node, eps: float, style: str) -> Site | None:
    out_node = last
    user = only_user(last)
    if op(user) in ("to", "_to_copy") and not user.kwargs.get("device"):
        out_node = user
    xs = strip(x)
    w = strip(w)
    params = {"eps": eps, "style": style, "out_dtype": str(node_dtype(out_node)).replace("torch.", "")}
    # fused residual add: the normalised value is a + b of two same-shape tensors
    if op(xs) == "add" and all(isinstance(a, Node) for a in xs.args[:2]) and len(xs.args) < 3:
        a, b = xs.args[0], xs.args[1]
        if node_shape(a) == node_shape(b) == node_shape(xs) and scalar(xs.kwargs.get("alpha", 1)) in (None, 1.0):
            extra = (
                {"residual_out": xs}
                if any(u not in region(out_node, [strip(a), strip(b), w]) for u in xs.users)
                else {}
            )
            params["sum_dtype"] = str(node_dtype(xs)).replace("torch.", "")
            site = _site(Kind.add_rmsnorm, out_node, {"x": strip(a), "residual": strip(b), "weight": w}, params, extra)
            if site is not None:
                return site
    return _site(Kind.rmsnorm, out_node, {"x": xs, "weight": w}, params)


# ------------------------------------------------------------------------------------------
# LayerNorm


def _layernorm_sites(gm: torch.fx.GraphModule) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        if op(n) == "layer_norm":
            shape = arg(n, 1, "normalized_shape")
            eps = arg(n, 4, "eps", 1e-5)
            p = {"eps": eps, "style": "layer_norm", "dims": len(shape) if isinstance(shape, list | tuple) else None}
            site = _site(Kind.layernorm, n, {"x": n.args[0], "weight": arg(n, 2, "weight"), "bias": arg(n, 3, "bias")},
                         p)  # fmt: skip
            if site:
                out.append(site)
            continue
        # manual: (x - mean(x)) * rsqrt(var(x) + eps) [* w] [+ b]
        if op(n) != "rsqrt" or op(n.args[0]) != "add" or scalar(n.args[0].args[1]) is None:
            continue
        var, eps = n.args[0].args[0], scalar(n.args[0].args[1])
        x = None
        if op(var) == "var" and is_last_dim(arg(var, 1, "dim"), node_rank(var.args[0])) and _biased(var):
            x = var.args[0]
        elif op(var) == "mean" and op(var.args[0]) == "pow" and op(var.args[0].args[0]) == "sub":
            x = var.args[0].args[0].args[0]
        if x is None:
            continue
        for u in n.users:
            if op(u) != "mul":
                continue
            centred = u.args[0] if u.args[1] is n else u.args[1]
            if op(centred) != "sub" or not same(centred.args[0], x) or op(centred.args[1]) != "mean":
                continue
            last, w, b = u, None, None
            nxt = only_user(last)
            if op(nxt) == "mul" and node_rank(nxt.args[1] if nxt.args[0] is last else nxt.args[0]) == 1:
                w, last = (nxt.args[1] if nxt.args[0] is last else nxt.args[0]), nxt
                nxt = only_user(last)
                if op(nxt) == "add" and node_rank(nxt.args[1] if nxt.args[0] is last else nxt.args[0]) == 1:
                    b, last = (nxt.args[1] if nxt.args[0] is last else nxt.args[0]), nxt
            site = _site(
                Kind.layernorm, last, {"x": x, "weight": w, "bias": b}, {"eps": eps, "style": "manual", "dims": 1}
            )
            if site:
                out.append(site)
    return out


def _biased(var: Node) -> bool:
    """A ``var`` node computing the biased variance LayerNorm uses (torch.var's default is the unbiased one)."""
    if getattr(var.target, "_overloadname", "") == "correction":
        return var.kwargs.get("correction") in (0, 0.0)
    return arg(var, 2, "unbiased", True) is False


# ------------------------------------------------------------------------------------------
# softmax


SOFTMAX_OPS = ("softmax", "_softmax", "_safe_softmax")


def _softmax_of(n: Node) -> tuple[Node, int] | None:
    """(x, dim) when ``n`` computes softmax(x, dim): the op, or exp(x - max) / sum(exp)."""
    if op(n) in SOFTMAX_OPS:
        return n.args[0], arg(n, 1, "dim")
    if op(n) == "div" and op(n.args[0]) == "exp" and op(n.args[1]) == "sum":
        e, s = n.args[0], n.args[1]
        if s.args[0] is not e or not arg(s, 2, "keepdim", False):
            return None
        inner = e.args[0]
        if op(inner) == "sub" and op(inner.args[1]) in ("amax", "max"):
            mx = inner.args[1]
            src = mx.args[0]
            if op(mx) == "max":  # max.dim returns (values, indices): getitem 0
                return None
            return src if same(src, inner.args[0]) else inner.args[0], _one_dim(arg(s, 1, "dim"))
        return inner, _one_dim(arg(s, 1, "dim"))
    return None


def _one_dim(d: Any) -> Any:
    return d[0] if isinstance(d, list | tuple) and len(d) == 1 else d


def _softmax_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out = []
    for n in gm.graph.nodes:
        if n in taken:
            continue
        got = _softmax_of(n)
        if got is None:
            continue
        x, dim = got
        if not is_last_dim(dim, node_rank(x)):
            continue
        last = n
        user = only_user(n)
        if op(user) in ("to", "_to_copy"):
            last = user
        xs = strip(x)
        p = {"dim": -1, "in_dtype": str(node_dtype(xs)).replace("torch.", ""),
             "out_dtype": str(node_dtype(last)).replace("torch.", "")}  # fmt: skip
        site = _site(Kind.softmax, last, {"x": xs}, p)
        if site:
            out.append(site)
    return out


# ------------------------------------------------------------------------------------------
# attention


def _transposed_last(n: Any) -> Node | None:
    """t when ``n`` is t with its last two dims swapped."""
    if op(n) == "transpose":
        r = node_rank(n)
        d = {a % r for a in n.args[1:3]} if r else set()
        if r and d == {r - 1, r - 2}:
            return n.args[0]
    if op(n) == "permute":
        perm = list(n.args[1])
        r = len(perm)
        if perm[:-2] == list(range(r - 2)) and perm[-2:] in ([r - 1, r - 2], [-1, -2]):
            return n.args[0]
    if op(n) in ("t", "numpy_T") and node_rank(n) == 2:
        return n.args[0]
    if op(n) in ("mT", "adjoint", "matrix_H") and node_rank(n) and node_rank(n) >= 2:
        return n.args[0]
    return None


def _unrepeat(t: Any) -> Node | None:
    """The kv tensor [B, Hkv, S, D] that ``t`` repeats over heads (GQA), as repeat_interleave(x, g, dim=1)
    or HF's repeat_kv x[:, :, None].expand(B, Hkv, g, S, D).reshape(B, Hkv * g, S, D); None otherwise."""
    base = strip(t)
    if op(base) == "repeat_interleave" and arg(base, 2, "dim") in (1, -3) and node_rank(base) == 4:
        return base.args[0]
    if op(base) in ("reshape", "view", "_unsafe_view") and node_rank(base) == 4:
        e = strip(base.args[0])
        if op(e) == "expand" and node_rank(e) == 5:
            u = e.args[0]
            while op(u) == "slice":
                u = u.args[0]
            if op(u) == "unsqueeze" and arg(u, 1, "dim") == 2 and node_rank(u.args[0]) == 4:
                return u.args[0]
    return None


def _causal_keep(mask: Any) -> bool:
    """The boolean keep-mask is tril(ones(S, S)) (query i sees keys j <= i)."""
    m = strip(mask)
    return (
        op(m) == "tril"
        and (len(m.args) < 2 or m.args[1] == 0)
        and op(strip(m.args[0])) in ("ones", "ones_like", "full")
    )


def _causal_drop(mask: Any) -> bool:
    """The boolean drop-mask is ~tril(ones) or triu(ones, 1)."""
    m = strip(mask)
    if op(m) in ("bitwise_not", "logical_not"):
        return _causal_keep(m.args[0])
    return (
        op(m) == "triu" and len(m.args) > 1 and m.args[1] == 1 and op(strip(m.args[0])) in ("ones", "ones_like", "full")
    )


def _from_scores(t: Any, hops: int = 6) -> bool:
    """``t`` is a product of two matrices through scales, masks and casts (the scores, not a mask)."""
    for _ in range(hops):
        t = strip(t)
        if op(t) in ("matmul", "bmm"):
            return True
        if op(t) in ("mul", "div", "masked_fill", "add") and isinstance(t.args[0], Node):
            t = t.args[0]
        elif op(t) == "where" and isinstance(t.args[1], Node):
            t = t.args[1]
        else:
            return False
    return False


def _attention_sites(gm: torch.fx.GraphModule) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        if op(n) == "scaled_dot_product_attention":
            q, k, v = n.args[:3]
            p = {"style": "sdpa", "causal": bool(arg(n, 5, "is_causal", False)), "scale": arg(n, 6, "scale"),
                 "dropout": arg(n, 4, "dropout_p", 0.0), "gqa": bool(n.kwargs.get("enable_gqa", False)),
                 "mask": "tensor" if isinstance(arg(n, 3, "attn_mask"), Node) else "none"}  # fmt: skip
            site = _site(Kind.attention, n, {"q": q, "k": k, "v": v, "mask": arg(n, 3, "attn_mask")}, p)
            if site:
                out.append(site)
            continue
        if op(n) not in SOFTMAX_OPS or not is_last_dim(arg(n, 1, "dim"), node_rank(n.args[0])):
            continue
        # forward: softmax -> [cast] -> [dropout p=0] -> matmul(p, v)
        pv, cur = None, n
        for _ in range(3):
            u = only_user(cur)
            if u is None:
                break
            if op(u) in ("matmul", "bmm") and u.args[0] is cur:
                pv = u
                break
            if op(u) in ("to", "_to_copy", "dropout") or (op(u) == "dropout" and scalar(u.args[1]) == 0.0):
                if op(u) == "dropout" and scalar(u.args[1]) not in (0.0, None):
                    break
                cur = u
                continue
            break
        if pv is None or node_rank(pv) not in (3, 4):
            continue
        # backward: scores -> [mask] -> [scale] -> matmul(q, k^T)
        s = n.args[0]
        mask, causal, scale, mask_kind = None, False, 1.0, "none"
        scale_nodes: list[tuple[str, Node]] = []
        # walking back from the softmax, a scale met before the mask was applied after it: the mask is scaled too
        # (an additive mask's values then count times those scales, not the ones applied before it; -inf stays -inf):
        # mask_scale is their constant product, the first mask_scale_nodes of scale_nodes their size factors
        mask_scale, mask_scale_nodes = 1.0, 0
        for _ in range(4):
            s = strip(s) if op(s) in ("to", "_to_copy") else s
            if op(s) == "masked_fill" and scalar(s.args[2]) == -math.inf:
                if _causal_drop(s.args[1]):
                    causal = True
                else:
                    mask, mask_kind, mask_scale, mask_scale_nodes = s.args[1], "drop", scale, len(scale_nodes)
                s = s.args[0]
            elif op(s) == "where" and scalar(s.args[2]) == -math.inf and isinstance(s.args[1], Node):
                if _causal_keep(s.args[0]):
                    causal = True
                else:
                    mask, mask_kind, mask_scale, mask_scale_nodes = s.args[0], "keep", scale, len(scale_nodes)
                s = s.args[1]
            elif op(s) == "add" and all(isinstance(t, Node) for t in s.args[:2]):
                # additive mask: the other operand of the one that leads back to the scores
                lead = [
                    t for t in s.args[:2] if op(strip(t)) in ("mul", "div", "matmul", "bmm", "masked_fill", "where")
                ]
                if len(lead) == 2:  # a mask built by arithmetic ((1 - m) * -10000, HF's): the scores lead to q @ k^T
                    lead = [t for t in lead if _from_scores(t)]
                if len(lead) != 1:
                    break
                mask, mask_kind = (s.args[1] if lead[0] is s.args[0] else s.args[0]), "add"
                mask_scale, mask_scale_nodes = scale, len(scale_nodes)
                s = lead[0]
            elif op(s) in ("mul", "div") and isinstance(s.args[1], Node) and _is_size_node(s.args[1]):
                scale_nodes.append((op(s), s.args[1]))  # a scale computed from sizes (d ** -0.5)
                s = s.args[0]
            elif op(s) == "mul" and scalar(s.args[1]) is not None:
                scale *= scalar(s.args[1])
                s = s.args[0]
            elif op(s) == "div" and scalar(s.args[1]) is not None:
                scale /= scalar(s.args[1])
                s = s.args[0]
            else:
                break
        if op(s) not in ("matmul", "bmm"):
            continue
        q, kt = s.args[0], s.args[1]
        k = _transposed_last(kt)
        if k is None or node_rank(q) != node_rank(k):
            continue
        v = pv.args[1]
        k0, v0 = _unrepeat(k), _unrepeat(v)
        gqa = k0 is not None and v0 is not None
        if gqa:
            k, v = k0, v0
        p = {"style": "explicit", "causal": causal, "gqa": gqa, "scale": scale, "dropout": 0.0, "mask": mask_kind,
             "mask_scaled": mask_scale != 1.0 or mask_scale_nodes > 0, "mask_scale": mask_scale,
             "mask_scale_nodes": mask_scale_nodes,
             "scale_ops": [o for o, _ in scale_nodes],
             "in_dtype": str(node_dtype(q)).replace("torch.", ""),
             "q_src_dtype": str(node_dtype(strip(q))).replace("torch.", "")}  # fmt: skip
        ins = {"q": q, "k": k, "v": v, "mask": mask, **{f"scale{i}": nd for i, (_, nd) in enumerate(scale_nodes)}}
        site = _site(Kind.attention, pv, ins, p)
        if site:
            out.append(site)
    return out


# ------------------------------------------------------------------------------------------
# GEMM with epilogues


EPILOGUE_POINTWISE = ACTIVATIONS | {"mul", "div", "add"}


def _gemm_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    for n in gm.graph.nodes:
        if n in taken:
            continue
        o = op(n)
        a = b = bias = None
        layout = None
        if o == "linear":
            a, b, bias = n.args[0], n.args[1], arg(n, 2, "bias")
            layout = "nk"
        elif o in ("mm", "matmul", "bmm"):
            a, rhs = n.args[0], n.args[1]
            bt = _transposed_last(rhs)
            b, layout = (bt, "nk") if bt is not None else (rhs, "kn")
        elif o == "addmm":
            bias, a, rhs = n.args[0], n.args[1], n.args[2]
            bt = _transposed_last(rhs)
            b, layout = (bt, "nk") if bt is not None else (rhs, "kn")
            if scalar(n.kwargs.get("beta", 1)) != 1.0 or scalar(n.kwargs.get("alpha", 1)) != 1.0:
                continue
        else:
            continue
        ra, rb = node_rank(a), node_rank(b)
        if ra is None or rb is None or ra < 2:
            continue
        batched = rb > 2
        epi: list[str] = []
        last = n
        residual = None
        scale = 1.0
        while True:
            u = only_user(last)
            if u is None or u in taken:
                break
            uo = op(u)
            other = None
            if uo in ("add", "mul", "div") and len(u.args) == 2:
                other = u.args[1] if u.args[0] is last else u.args[0]
            if uo == "add" and bias is None and isinstance(other, Node) and node_rank(other) == 1 and not epi:
                bias, last = other, u
                continue
            if uo in ACTIVATIONS and u.args[0] is last and not any(e in ACTIVATIONS for e in epi):
                approx = u.kwargs.get("approximate", arg(u, 1, "approximate", "none")) if uo == "gelu" else None
                epi.append(f"gelu_{approx}" if uo == "gelu" else uo)
                last = u
                continue
            if uo in ("mul", "div") and scalar(other) is not None and (uo == "mul" or u.args[0] is last):
                scale = scale * scalar(other) if uo == "mul" else scale / scalar(other)
                epi.append("scale")
                last = u
                continue
            if uo == "add" and isinstance(other, Node) and residual is None and node_shape(other) == node_shape(last):
                residual = other
                epi.append("residual")
                last = u
                continue
            break
        dtype = str(node_dtype(a)).replace("torch.", "")
        sa = node_shape(a)
        k = sa[-1] if sa and isinstance(sa[-1], int) else None  # the inner dimension when static
        p = {"op": o, "layout": layout, "batched": batched, "bias": bias is not None,
             "epilogue": "+".join(epi) or "none", "scale": scale, "dtype": dtype, "k": k}  # fmt: skip
        inputs = {"a": a, "b": b, "bias": bias, "residual": residual}
        site = _site(Kind.gemm, last, {k: v for k, v in inputs.items() if v is not None}, p)
        if site:
            site.params["core"] = n.name
            out.append(site)
    return out


# ------------------------------------------------------------------------------------------
# halves of a tensor's last dim (gated activations, RoPE)


def _half(n: Any) -> tuple[Node, int] | None:
    """(x, 0 or 1) when n is the first or second half of x's last dim (chunk/split getitem or slice)."""
    if isinstance(n, Node) and n.op == "call_function" and n.target is operator.getitem:
        src, idx = n.args[0], n.args[1]
        if (
            op(src) == "chunk"
            and arg(src, 1, "chunks") == 2
            and is_last_dim(arg(src, 2, "dim", 0), node_rank(src.args[0]))
        ):
            return src.args[0], idx
        if op(src) in ("split", "split_with_sizes") and is_last_dim(arg(src, 2, "dim", 0), node_rank(src.args[0])):
            sizes = src.args[1]
            # two equal halves: [h, h], or a chunk size h of a 2h-wide dim
            if isinstance(sizes, list | tuple):
                if len(sizes) == 2 and str(sizes[0]) == str(sizes[1]):
                    return src.args[0], idx
            else:
                shape = node_shape(src.args[0])
                if shape and str(shape[-1]) in (str(2 * sizes), str(sizes * 2)):
                    return src.args[0], idx
    if op(n) == "slice" and is_last_dim(n.args[1], node_rank(n.args[0])) and (len(n.args) < 5 or n.args[4] == 1):
        start = n.args[2] if len(n.args) > 2 else 0
        return n.args[0], 0 if start in (0, None) else 1
    return None


# ------------------------------------------------------------------------------------------
# leftovers: elementwise chains and reductions


def _is_pointwise(n: Node) -> bool:
    t = n.target
    tags = getattr(t, "tags", ())
    return op(n) is not None and torch.Tag.pointwise in tags


def _leftover_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    seen: set[Node] = set()
    for n in gm.graph.nodes:
        if n in taken or n in seen:
            continue
        if op(n) in REDUCTIONS:
            out.append(Site(Kind.reduction, n, {n}, {"x": n.args[0]}, {"op": op(n)}))
            continue
        if not _is_pointwise(n):
            continue
        # connected component of pointwise nodes (through producer/consumer edges)
        comp: set[Node] = set()
        todo = [n]
        while todo:
            m = todo.pop()
            if m in comp or m in taken or not _is_pointwise(m):
                continue
            comp.add(m)
            todo += [a for a in m.all_input_nodes] + list(m.users)
        seen |= comp
        if len(comp) >= 2:
            order = [m for m in gm.graph.nodes if m in comp]
            out.append(Site(Kind.elementwise, order[-1], comp, {}, {"ops": len(comp)}))
    return out
