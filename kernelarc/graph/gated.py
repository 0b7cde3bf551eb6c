"""Gated activations (SwiGLU, GeGLU, ReGLU, GLU): ``act(gate) * up``, recognised by what the gate's
sub-graph computes rather than by how it is written.

The product is a tree of ``mul`` nodes; one leaf is ``up``, and the rest of the tree is an elementwise
function of a single graph value ``gate`` (``F.gelu(g)``, ``0.5 * g * (1 + erf(g / sqrt(2)))``,
``0.5 * g * (1 + tanh(sqrt(2 / pi) * (g + 0.044715 * g ** 3)))``, ``g * sigmoid(g)``, ``F.silu(g)``, ...).
That function is evaluated in float64 on sample points and compared with the activations the
families implement (``ACTIVATIONS``), with ``up`` set to 1 and to 2 (the product must be linear in
``up``). Casts inside the sub-graph are identities for the evaluation (the family computes in fp32).
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch.fx import Node

from kernelarc.graph.capture import node_dtype
from kernelarc.graph.patterns import TRANSPARENT, Kind, Site, _half, _site, op, strip

# the activation of a gate, by name, in float64 (names follow the GEMM epilogues': gelu_<approximate>)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu_none": lambda g: F.gelu(g),
    "gelu_tanh": lambda g: F.gelu(g, approximate="tanh"),
    "relu": torch.relu,
    "sigmoid": torch.sigmoid,
}
_SAMPLES = torch.linspace(-6.0, 6.0, 241, dtype=torch.float64)
_MAX_TREE = 12  # leaves of a product tree looked at (a gate's product has a handful)


def _is_elementwise(n: Node) -> bool:
    tags = getattr(n.target, "tags", ())
    return op(n) in TRANSPARENT or (op(n) is not None and torch.Tag.pointwise in tags)


def _leaves(n: Node) -> tuple[list[Node], set[Node]]:
    """The Node leaves of the mul tree rooted at ``n`` (through muls read only inside the tree), and
    the tree's inner nodes."""
    leaves: list[Node] = []
    inner: set[Node] = set()
    todo = [n]
    while todo and len(leaves) <= _MAX_TREE:
        m = todo.pop()
        if op(m) == "mul" and (m is n or len(m.users) == 1):
            inner.add(m)
            todo += [a for a in m.args[:2] if isinstance(a, Node)]
        else:
            leaves.append(m)
    return leaves, inner


def _evaluate(out: Node, region: set[Node], env: dict[Node, torch.Tensor]) -> torch.Tensor | None:
    """``out``'s value from ``env`` through ``region`` (graph order), casts as identities."""
    vals = dict(env)
    order = [m for m in out.graph.nodes if m in region]

    def get(a: Any) -> Any:
        if isinstance(a, Node):
            return vals[a]
        if isinstance(a, list | tuple):
            return type(a)(get(x) for x in a)
        return a

    try:
        for m in order:
            if op(m) in TRANSPARENT:
                vals[m] = get(m.args[0])
                continue
            args = [get(a) for a in m.args]
            kwargs = {k: get(v) for k, v in m.kwargs.items() if k not in ("dtype", "device", "layout")}
            vals[m] = m.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that does not run on these samples: not an activation
        return None
    v = vals.get(out)
    return v if isinstance(v, torch.Tensor) and v.shape == _SAMPLES.shape else None


def activation_of(out: Node, gate: Node, up: Node | None) -> str | None:
    """The name of the activation ``act`` with ``out == act(gate) * up`` (``out == act(gate)`` when
    ``up`` is None), from evaluating the sub-graph between them; None when it is none of ACTIVATIONS."""
    stops = {gate} | ({up} if up is not None else set())
    region: set[Node] = set()
    todo = [out]
    while todo:
        m = todo.pop()
        if m in region or m in stops:
            continue
        if m.op != "call_function" or not _is_elementwise(m) or m.target is operator.getitem:
            return None
        region.add(m)
        todo += m.all_input_nodes
        if len(region) > 40:
            return None
    if not region or gate in region:
        return None
    uses_gate = any(gate in m.all_input_nodes for m in region)
    if not uses_gate or (up is not None and not any(up in m.all_input_nodes for m in region)):
        return None
    g = _SAMPLES
    one = _evaluate(out, region, {gate: g, **({up: torch.ones_like(g)} if up is not None else {})})
    if one is None:
        return None
    if up is not None:
        two = _evaluate(out, region, {gate: g, up: torch.full_like(g, 2.0)})
        if two is None or not torch.allclose(two, 2 * one, rtol=1e-9, atol=1e-12):
            return None
    for name, fn in ACTIVATIONS.items():
        if torch.allclose(one, fn(g), rtol=1e-7, atol=1e-9):
            return name
    return None


LOW_FLOATS = (torch.bfloat16, torch.float16)


def act_rounding(product: Node, up: Node) -> str | None:
    """The dtype (``bfloat16`` / ``float16``) the reference rounds ``act(gate)`` to before the product
    (``F.silu(g) * u`` on bf16 tensors: silu's result is a bf16 tensor, then the product is rounded
    again), None where the activation stays in fp32 up to the product. The family computes in fp32 and
    rounds once at the store, so without this a bf16 problem's SwiGLU is one ulp off in about half its
    elements (L2/004: 99.54% within tolerance on the H200); with it, the kernel rounds where the
    reference does."""
    if up not in product.args[:2]:
        return None
    a = product.args[1] if product.args[0] is up else product.args[0]
    dt = node_dtype(a) if isinstance(a, Node) else None
    return str(dt).replace("torch.", "") if dt in LOW_FLOATS else None


def glu_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    """``act(gate) * up`` sites: packed (gate and up the two halves of one tensor's last dim, as
    the SwiGLU family reads them) or separate tensors."""
    out: list[Site] = []
    covered: set[Node] = set()
    for n in gm.graph.nodes:
        if n in taken or n in covered or op(n) != "mul" or not all(isinstance(a, Node) for a in n.args[:2]):
            continue
        leaves, _ = _leaves(n)
        found = None
        for up in leaves:
            gates = [x for x in leaves if x is not up]
            gates += [a for x in gates for a in x.all_input_nodes]
            for gate in dict.fromkeys(gates):
                if gate is up or strip(gate) is strip(up):
                    continue
                act = activation_of(n, gate, up)
                if act is not None:
                    found = (act, gate, up)
                    break
            if found:
                break
        if found is None:
            continue
        act, gate, up = found
        last = n
        user = next(iter(n.users)) if len(n.users) == 1 else None
        if op(user) in ("to", "_to_copy") and not user.kwargs.get("device"):
            last = user
        hg, hl = _half(strip(gate)), _half(strip(up))
        out_dtype = str(node_dtype(last)).replace("torch.", "")
        if hg and hl and hg[0] is hl[0] and hg[1] == 0 and hl[1] == 1:
            params = {"act": act, "packed": True, "out_dtype": out_dtype, "act_round": act_rounding(n, up)}
            site = _site(Kind.glu, last, {"x": strip(hg[0])}, params)
        else:
            params = {"act": act, "packed": False, "out_dtype": out_dtype, "act_round": act_rounding(n, up)}
            site = _site(Kind.glu, last, {"gate": gate, "up": up}, params)
        if site:
            out.append(site)
            covered |= site.nodes
    return out


__all__ = ["ACTIVATIONS", "act_rounding", "activation_of", "glu_sites"]
