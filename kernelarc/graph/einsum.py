"""Two-operand ``einsum`` contractions rewritten as ``matmul`` in a captured graph.

``make_fx`` keeps ``torch.einsum`` as one ``aten.einsum`` node, which none of the recognisers reads: attention
written ``einsum('bhqd,bhkd->bhqk', q, k)`` ... ``einsum('bhqk,bhkd->bhqd', p, v)`` (common in encoder and
research code) was neither an attention nor a GEMM site. An equation that is a (batched) matrix product is
rewritten here as the ``permute`` / ``matmul`` / ``permute`` the recognisers know (``einsum`` itself computes
it with the same ``bmm``); any other equation (three operands, ``...``, a repeated index, an index summed
within one operand, several contracted indices) is left as it is.

Each index of a rewritten equation is one of: batch (both operands and the output), contracted (both operands,
not the output; exactly one), free in the first operand (it and the output) or free in the second (one at most;
the first may have several where the second has no batch index, as in ``'bsd,hd->bsh'``).
"""

from __future__ import annotations

import logging
from typing import Any, NamedTuple

import torch
import torch.fx

log = logging.getLogger(__name__)

_EINSUM = torch.ops.aten.einsum.default
_PERMUTE = torch.ops.aten.permute.default
_MATMUL = torch.ops.aten.matmul.default


class Plan(NamedTuple):
    pa: list[int]  # the permutation of the first operand
    pbs: list[list[int]]  # the permutations of the second, in turn
    po: list[int] | None  # of the matmul's result into the output's order (None: that order already)
    contracted: tuple[int, int]  # the contracted index's position in each operand


def plan(equation: str) -> Plan | None:
    """How an equation that is a matrix product is computed with ``matmul`` (None for any other equation).

    The second operand goes to [batch, contracted, free] directly where it is in that order already, else to
    [batch, free, contracted] and then its last two dims swapped: the recognisers read ``k`` in ``q @ k^T``
    through one swap of the last two dims (``einsum('bqhd,bkhd->bhqk')`` gives ``q @ k.permute(0, 2, 1, 3)^T``)."""
    eq = equation.replace(" ", "")
    if "->" not in eq or "." in eq:
        return None
    lhs, out = eq.split("->")
    ops = lhs.split(",")
    if len(ops) != 2:
        return None
    a, b = ops
    if not (a.isalpha() and b.isalpha() and (out.isalpha() or out == "")):
        return None
    if any(len(set(s)) != len(s) for s in (a, b, out)):
        return None  # a diagonal
    if set(out) - set(a) - set(b):
        return None
    batch = [c for c in out if c in a and c in b]
    contracted = [c for c in a if c in b and c not in out]
    free_a = [c for c in out if c in a and c not in b]
    free_b = [c for c in out if c in b and c not in a]
    if (set(a) | set(b)) != set(batch) | set(contracted) | set(free_a) | set(free_b):
        return None  # an index summed within one operand
    if len(contracted) != 1 or len(free_b) != 1 or not free_a or (len(free_a) > 1 and batch):
        return None
    pa = [a.index(c) for c in [*batch, *free_a, *contracted]]
    pb = [b.index(c) for c in [*batch, *contracted, *free_b]]
    if pb == list(range(len(pb))):
        pbs = [pb]
    else:
        first = [b.index(c) for c in [*batch, *free_b, *contracted]]
        r = len(b)
        pbs = [first, [*range(r - 2), r - 1, r - 2]]
    result = [*batch, *free_a, *free_b]
    po = [result.index(c) for c in out]
    c = contracted[0]
    return Plan(pa, pbs, None if po == list(range(len(po))) else po, (a.index(c), b.index(c)))


def _permuted(node: torch.fx.Node, src: Any, perm: list[int]) -> None:
    """``node.meta['val']``: ``src``'s value (a node's, or a fake tensor) permuted by ``perm``."""
    v = src.meta.get("val") if isinstance(src, torch.fx.Node) else src
    if isinstance(v, torch.Tensor):
        node.meta["val"] = v.permute(perm)


def _same_contracted(p: Plan, operands: list[torch.fx.Node]) -> bool:
    """The contracted index has one size in both operands (as traced): einsum broadcasts a size-1 one, matmul does
    not (``'Ab,Af->fb'`` on [1, 3] and [3, 5])."""
    from kernelarc.graph.capture import node_shape, static_int

    shapes = [node_shape(o) for o in operands]
    if any(s is None for s in shapes):
        return False
    sa, sb = (shape[i] for shape, i in zip(shapes, p.contracted, strict=True))
    return (static_int(sa) == 1) == (static_int(sb) == 1)


def rewrite(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``gm``'s matrix-product einsums in place (``plan``); returns how many."""
    done = 0
    g = gm.graph
    for n in list(g.nodes):
        if n.op != "call_function" or n.target is not _EINSUM or n.kwargs:
            continue
        eq, operands = n.args[0], n.args[1] if len(n.args) > 1 else None
        if not isinstance(eq, str) or not isinstance(operands, list | tuple) or len(operands) != 2:
            continue
        if not all(isinstance(o, torch.fx.Node) for o in operands):
            continue
        p = plan(eq)
        if p is None or not _same_contracted(p, operands):
            continue
        po = p.po
        with g.inserting_before(n):
            ins = []
            for x, perms in zip(operands, ([p.pa], p.pbs), strict=True):
                for perm in perms:
                    if perm != list(range(len(perm))):
                        t = g.call_function(_PERMUTE, (x, perm))
                        _permuted(t, x, perm)
                        x = t
                ins.append(x)
            mm = g.call_function(_MATMUL, tuple(ins))
            # the values (fake tensors: shapes, dtypes) from the einsum's own, which has the product's
            val = n.meta.get("val")
            if po is not None:
                _permuted(mm, val, [po.index(i) for i in range(len(po))])
                res = g.call_function(_PERMUTE, (mm, po))
                _permuted(res, mm, po)
            else:
                if isinstance(val, torch.Tensor):
                    mm.meta["val"] = val
                res = mm
        res.meta.update({k: v for k, v in n.meta.items() if k not in ("val", "tensor_meta")})
        n.replace_all_uses_with(res)
        g.erase_node(n)
        done += 1
    if done:
        g.lint()
        gm.recompile()
        log.debug("einsum: %d contraction(s) rewritten as matmul", done)
    return done
