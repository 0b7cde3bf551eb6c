"""Emit a whole-problem candidate from the captured graph with recognised sites replaced.

The candidate is one module, built as text (nothing is ``exec``'d, so the guard's static checks
see every line):

* the parts: each family kernel's rendered module and the reference itself, renamed with
  ``kernelarc.dispatch.rename_part``-style prefixes (``_k0_``, ``_ref_``) and imports hoisted;
* one function per graph case (``_case0``...): the captured graph as plain ``torch.ops.aten``
  calls, with every substituted site's nodes replaced by its adapter lines;
* the graph-level knobs: the rest of the graph eager or under ``torch.compile`` (Inductor options
  as knobs), CUDA-graph replay for launch-bound workloads (static input buffers, fresh inputs
  copied in, outputs cloned), sites' implementations (graph / library / family);
* ``run(*args)``: picks the case by the input signature (shapes, dtypes, scalar values) among the
  workloads each graph was traced and checked for, and runs the reference for anything else.
"""

from __future__ import annotations

import ast
import math
import operator
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.adapters import AdapterError, Ctx, Impl, site_lines
from kernelarc.graph.capture import Capture, GraphCase
from kernelarc.graph.patterns import Site


class CompositionError(ValueError):
    """The graph cannot be emitted as source (an unsupported node or constant)."""


@dataclass
class SitePlan:
    site: Site
    impl: Impl
    part: str | None = None  # prefix of the family part serving it


@dataclass
class CasePlan:
    case: GraphCase
    sites: list[SitePlan] = field(default_factory=list)


@dataclass(frozen=True)
class GraphKnobs:
    rest: str = "eager"  # eager | inductor
    max_autotune: bool = False
    coordinate_descent: bool = False
    epilogue_fusion: bool = True
    cuda_graph: bool = False
    matmul_precision: str = "highest"  # highest | high (TF32 for fp32 matmuls: precision within tolerance)
    sdpa_backend: str = "auto"
    attn_precision: str = "reference"  # reference | low
    # rest under Inductor: family kernel calls stay outside the compiled graphs (torch.compiler.disable,
    # a graph break around each) or dynamo traces them (user-defined Triton kernels inside the graph)
    trace_kernels: bool = False
    # rest under Inductor: round every fused op's result to its bf16 / fp16 dtype as eager does (Inductor's
    # emulate_precision_casts) instead of carrying fp32 through the fused chain
    emulate_casts: bool = False


# Inputs up to this size are copied into a graph's static buffers per call; larger ones are read in place by one
# graph per set of input addresses (RUNTIME's _bound_graphed), whose outputs must stay under it too.
CUDA_GRAPH_MAX_BYTES = 64 * 2**20


# ------------------------------------------------------------------------------------------
# node -> expression


def _var(n: Node) -> str:
    return f"v_{n.name}"


def _namer(known: set[Node], where: str = "") -> Callable[[Any], str]:
    """The expression for an argument in generated code: a node's variable once it is in ``known`` (a set the
    caller may still grow), a literal as ``_fmt`` writes it; a node read before it is computed is an error."""

    def name(a: Any) -> str:
        if isinstance(a, Node):
            if a not in known:
                raise CompositionError(f"value {a.name} is read before it is computed{where}")
            return _var(a)
        return _fmt(a, name)

    return name


def _fmt(a: Any, name) -> str:
    if isinstance(a, Node):
        return name(a)
    if isinstance(a, list):
        return "[" + ", ".join(_fmt(x, name) for x in a) + "]"
    if isinstance(a, tuple):
        inner = ", ".join(_fmt(x, name) for x in a)
        return f"({inner},)" if len(a) == 1 else f"({inner})"
    if isinstance(a, bool) or a is None or isinstance(a, str | int):
        return repr(a)
    if isinstance(a, float):
        if math.isnan(a):
            return "math.nan"
        if math.isinf(a):
            return "math.inf" if a > 0 else "-math.inf"
        return repr(a)
    if isinstance(a, torch.dtype | torch.layout | torch.memory_format):
        return str(a)
    if isinstance(a, torch.device):
        return "_dev"
    raise CompositionError(f"cannot write constant {a!r} ({type(a).__name__}) as source")


def _callee(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        packet = target.overloadpacket.__name__
        return f"torch.ops.{ns}.{packet}.{target._overloadname}"
    mod = getattr(target, "__module__", None)
    name = getattr(target, "__name__", None)
    if mod == "math" and name:
        return f"math.{name}"
    if mod and name and (mod == "torch" or mod.startswith("torch.")) and hasattr(torch, name):
        return f"torch.{name}"
    if mod == "builtins" and name in ("int", "float", "bool", "abs", "min", "max", "round", "len"):
        return name
    raise CompositionError(f"cannot write a call to {target!r} as source")


# Python operators on sizes (SymInt arithmetic) written infix: the static checks ban the operator module.
_INFIX = {operator.add: "+", operator.sub: "-", operator.mul: "*", operator.truediv: "/", operator.floordiv: "//",
          operator.mod: "%", operator.pow: "**", operator.eq: "==", operator.ne: "!=", operator.lt: "<",
          operator.le: "<=", operator.gt: ">", operator.ge: ">=", operator.and_: "&", operator.or_: "|"}  # fmt: skip
_PREFIX = {operator.neg: "-", operator.pos: "+", operator.not_: "not "}


def _node_line(n: Node, name) -> str:
    if n.op != "call_function":
        raise CompositionError(f"unsupported node {n.op} {n.target}")
    if n.target is operator.getitem:
        return f"{_var(n)} = {name(n.args[0])}[{_fmt(n.args[1], name)}]"
    if n.target in _INFIX and len(n.args) == 2 and not n.kwargs:
        return f"{_var(n)} = {_fmt(n.args[0], name)} {_INFIX[n.target]} {_fmt(n.args[1], name)}"
    if n.target in _PREFIX and len(n.args) == 1 and not n.kwargs:
        return f"{_var(n)} = {_PREFIX[n.target]}{_fmt(n.args[0], name)}"
    args = [_fmt(a, name) for a in n.args]
    args += [f"{k}={_fmt(v, name)}" for k, v in n.kwargs.items()]
    return f"{_var(n)} = {_callee(n.target)}({', '.join(args)})"


def _output_expr(out: Any, name) -> str:
    return _fmt(out, name)


# ------------------------------------------------------------------------------------------
# one graph case as a function


def emit_case(fname: str, plan: CasePlan, knobs: Mapping[str, Any]) -> list[str]:
    gm = plan.case.gm
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    covered: dict[Node, SitePlan] = {}
    for sp in plan.sites:
        for n in sp.site.nodes:
            covered[n] = sp
    outputs: dict[Node, SitePlan] = {}
    for sp in plan.sites:
        outputs[sp.site.output] = sp
    defined: set[Node] = set(placeholders)

    name = _namer(defined, " (inside a replaced site)")

    params = ", ".join(_var(p) for p in placeholders)
    body: list[str] = []
    tensors = [p for p in placeholders if isinstance(p.meta.get("val"), torch.Tensor)]
    if tensors:
        body.append(f"_dev = {_var(tensors[0])}.device")
    for n in gm.graph.nodes:
        if n.op in ("placeholder",):
            continue
        if n.op == "output":
            body.append(f"return {_output_expr(n.args[0], name)}")
            continue
        sp = covered.get(n)
        if sp is None:
            if n.op == "get_attr":
                raise CompositionError(f"graph constant {n.target} (a tensor baked in the reference) is not supported")
            body.append(_node_line(n, name))
            defined.add(n)
            continue
        if n is not sp.site.output:
            continue
        extra = {role: _var(node) for role, node in sp.site.extra_outputs.items()}

        def fallback(site: Site = sp.site) -> list[str]:
            # the site's own nodes, for inputs a family kernel does not cover (read inside the branch only)
            inner_name = _namer(set(defined) | site.nodes)
            return [_node_line(m, inner_name) for m in gm.graph.nodes if m in site.nodes]

        try:
            ctx = Ctx(name=name, part=sp.part, knobs=dict(knobs), fallback=fallback)
            lines = site_lines(sp.site, sp.impl, ctx, _var(n), extra)
        except AdapterError as e:
            raise CompositionError(str(e)) from e
        body.append(f"# {sp.site.describe()} -> {sp.impl.value}{f' ({sp.part})' if sp.part else ''}")
        body += lines
        defined.add(n)
        defined.update(sp.site.extra_outputs.values())
    return [f"def {fname}({params}):", *["    " + ln for ln in body]]


def check_case(plan: CasePlan, knobs: Mapping[str, Any]) -> None:
    """Raise CompositionError when the case's source cannot be emitted (used to drop a site)."""
    emit_case("_check", plan, knobs)
    for sp in plan.sites:
        site_order = list(plan.case.gm.graph.nodes)
        pos = site_order.index(sp.site.output)
        for node in sp.site.extra_outputs.values():
            if any(site_order.index(u) < pos for u in node.users if u not in sp.site.nodes):
                raise CompositionError(f"{node.name} is read before the site's output is computed")


# ------------------------------------------------------------------------------------------
# the whole module


RUNTIME = """

def _kernelarc_signature(args):
    return tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a) for a in args)


def _impl(*args):
    # only the input signatures the graphs were traced and checked for; anything else runs the reference
    fn = _SIGNATURES.get(_kernelarc_signature(args))
    if fn is None:
        return _ref_run(*args)
    with torch.no_grad():
        return fn(*args)


def _clone_out(out):
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple | list):
        return type(out)(_clone_out(o) for o in out)
    return out


_GRAPHS = {}
_BOUND = {}  # signature -> {input addresses: (replay, outputs)}, the least recently used first
_WARMED = {}  # signature -> calls run as they are before its first capture
_POOLS = {}  # signature -> the memory pool of its graphs (the address-bound ones share it)
_UNGRAPHED = set()  # signatures run as they are: outputs too large for a launch-bound call
BOUND_GRAPHS = 8  # address-bound graphs kept per signature (the judge times on one buffer set per seed, 3 by default)


def _on_cuda(tensors):
    return bool(tensors) and all(t.is_cuda for t in tensors)


def _capture(fn, args, sig):
    # one CUDA graph of fn(*args), reading args where they are, in the memory pool of its signature's graphs;
    # its replay and its static outputs
    pool = _POOLS.get(sig)
    if pool is None:
        pool = _POOLS[sig] = torch.cuda.graph_pool_handle()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn(*args)
    return graph.replay, out


def _out_bytes(out):
    if isinstance(out, torch.Tensor):
        return out.nbytes
    if isinstance(out, tuple | list):
        return sum(_out_bytes(o) for o in out)
    return 0


def _bound_graphed(args, tensors, sig):
    # Inputs too large to copy into static buffers per call (a decoder layer's weights at batch 1): one graph
    # per set of input addresses, captured reading the caller's tensors in place and sharing one memory pool
    # per signature. A later call with tensors of the same layout at the same addresses (the judge times on a
    # few buffer sets refilled in place) replays it without copying any input: new content, new results.
    # The first two calls of a signature run as they are (compilation, warm-up); outputs over
    # CUDA_GRAPH_MAX_BYTES mean a call that is not launch-bound, which then always runs as it is. At most
    # BOUND_GRAPHS per signature, the least recently used dropped first.
    warmed = _WARMED.get(sig, 0)
    if sig in _UNGRAPHED or warmed < 2:
        _WARMED[sig] = warmed + 1
        out = _impl(*args)
        if _out_bytes(out) > CUDA_GRAPH_MAX_BYTES:
            _UNGRAPHED.add(sig)
        return out
    cache = _BOUND.setdefault(sig, {})
    key = tuple(t.data_ptr() for t in tensors)
    entry = cache.pop(key, None)
    if entry is None:
        while len(cache) >= BOUND_GRAPHS:
            cache.pop(next(iter(cache)))
        # a capture that fails (a host read, a sync) fails the call, as the copying replay's does: a failed capture
        # can leave the thread on the capture's side stream, where nothing after it belongs
        entry = _capture(_impl, args, sig)
    cache[key] = entry
    replay, out = entry
    replay()
    return _clone_out(out)


def _graphed(*args):
    # CUDA-graph replay for launch-bound workloads; outputs are cloned so a later call does not overwrite
    # what a caller holds. Small inputs are copied into static buffers captured once per signature, so
    # fresh inputs give fresh results; larger ones are read in place (_bound_graphed).
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    if not _on_cuda(tensors):
        return _impl(*args)
    sig = _kernelarc_signature(args) + tuple(t.stride() for t in tensors)
    if sum(t.nbytes for t in tensors) > CUDA_GRAPH_MAX_BYTES:
        return _bound_graphed(args, tensors, sig)
    entry = _GRAPHS.get(sig)
    if entry is None:
        static = [a.clone() if isinstance(a, torch.Tensor) else a for a in args]
        _impl(*static)
        _impl(*static)
        entry = _GRAPHS[sig] = (static, *_capture(_impl, static, sig))
    static, replay, out = entry
    for s, a in zip(static, args):
        if isinstance(a, torch.Tensor):
            s.copy_(a)
    replay()
    return _clone_out(out)


def _kernelarc_rope_layout(x, c, s, half, keep=False):
    # x [..., D] and cos / sin broadcastable to it (the last dim D, or D / 2 with ``half``): x as
    # [T, H, D] (H: the trailing leading dims cos / sin do not vary over, T: the others) and cos / sin
    # as [T, D / 2] ([T, D] with ``keep``: both halves' own values; views where the shapes allow); None
    # when they do not fit the RoPE kernels
    if x.dim() < 2 or x.shape[-1] % 2 or c.shape != s.shape or c.dim() > x.dim() or x.numel() == 0:
        return None
    d = x.shape[-1]
    w = d // 2 if half else d
    cs = (1,) * (x.dim() - c.dim()) + tuple(c.shape)
    lead, cl = tuple(x.shape[:-1]), cs[:-1]
    if cs[-1] != w or any(a != b and a != 1 for a, b in zip(cl, lead)):
        return None
    k = len(lead)
    while k > 0 and cl[k - 1] == 1:
        k -= 1
    t, h = math.prod(lead[:k]), math.prod(lead[k:])
    full = (*lead[:k], *cl[k:], w)
    n = d if keep else d // 2
    c2 = c.reshape(cs).expand(full)[..., :n].reshape(t, n)
    s2 = s.reshape(cs).expand(full)[..., :n].reshape(t, n)
    return x.reshape(t, h, d), c2, s2


def _values_traced(args):
    # a graph that baked host-read inputs (segment offsets) runs only on the values it was traced with: read on
    # the host here, outside any CUDA-graph capture, as the reference reads them
    want = _VALUES.get(_kernelarc_signature(args))
    return want is None or all(args[i].flatten().tolist() == v for i, v in want)


def run(*args):
    if _VALUES and not _values_traced(args):
        return _ref_run(*args)
    if CUDA_GRAPH:
        return _graphed(*args)
    return _impl(*args)
"""


def _compile_wrap(fname: str, k: GraphKnobs) -> str:
    if k.rest == "eager":
        return f"{fname}_fn = {fname}"
    opts = {
        "max_autotune": k.max_autotune,
        "coordinate_descent_tuning": k.coordinate_descent,
        "epilogue_fusion": k.epilogue_fusion,
    }
    if k.emulate_casts:
        opts["emulate_precision_casts"] = True
    return f"{fname}_fn = torch.compile({fname}, dynamic=None, options={opts!r})"


def _is_main_guard(node: Any) -> bool:
    """``if __name__ == "__main__":`` (either operand order), with no ``else``."""
    import ast

    if not isinstance(node, ast.If) or node.orelse:
        return False
    t = node.test
    if not (isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq)):
        return False
    sides = [t.left, t.comparators[0]]
    names = [x for x in sides if isinstance(x, ast.Name) and x.id == "__name__"]
    consts = [x for x in sides if isinstance(x, ast.Constant) and x.value == "__main__"]
    return len(names) == 1 and len(consts) == 1


def drop_main_guard(source: str) -> str:
    """``source`` without its top-level ``if __name__ == "__main__":`` blocks.

    A candidate is imported, never run as a script, so such a block is dead code there; but its
    ``"__main__"`` literal is what the guard's static check rejects (the string that reaches
    ``sys.modules["__main__"]``, the harness's own module). References carry such blocks (a demo
    call on the GPU), so every source that embeds a reference drops them first. Lines are cut,
    not re-unparsed, so the rest keeps its text (and line-based renaming still applies)."""
    import ast

    tree = ast.parse(source)
    cut = [(n.lineno, n.end_lineno or n.lineno) for n in tree.body if _is_main_guard(n)]
    if not cut:
        return source
    lines = source.splitlines(keepends=True)
    keep = [ln for i, ln in enumerate(lines, 1) if not any(lo <= i <= hi for lo, hi in cut)]
    return "".join(keep)


def emit_module(
    title: str,
    knobs_doc: Mapping[str, Any],
    cap: Capture,
    plans: Sequence[CasePlan],
    parts: Mapping[str, str],
    reference: str,
    k: GraphKnobs,
) -> str:
    """The candidate source. ``parts`` maps a prefix (``_k0_``) to a rendered family module."""
    from kernelarc.dispatch import CompositionError as DispatchCompositionError
    from kernelarc.dispatch import import_binds, rename_part

    hoisted: list[str] = []
    bodies: list[str] = []
    bound: dict[str, tuple[str, str]] = {}  # name -> (what it refers to, the statement binding it)
    try:
        renamed = [(p, rename_part(src, p)) for p, src in list(parts.items()) + [("_ref_", drop_main_guard(reference))]]
    except DispatchCompositionError as e:
        raise CompositionError(str(e)) from e
    for prefix, part in renamed:
        for text, binds in part.imports:
            for n, target in binds.items():  # what is bound, not how it is spelled (import os, sys binds os too)
                prev = bound.setdefault(n, (target, text))
                if prev[0] != target:
                    raise CompositionError(f"parts import different things as {n!r}: {prev[1]!r} vs {text!r}")
            if text not in hoisted:
                hoisted.append(text)
        bodies += ["", f"# ---- part {prefix}" + "-" * 40, "", part.body]
    # library calls are written fully qualified (torch.nn.functional.*), so no alias can clash with a part's
    base = ["import math", "import torch", "import torch.nn.attention", "import torch.nn.functional"]
    traced = k.rest != "eager" and k.trace_kernels and bool(parts)
    base += ["import os"] if traced else []  # the interpreter check of traced calls (below)
    for b in base:
        for n, target in import_binds(ast.parse(b).body[0]).items():
            if n in bound and bound[n][0] != target:
                raise CompositionError(f"a part binds {n!r} as {bound[n][1]!r}, the composition needs {b!r}")
    imports = [b for b in base if b not in hoisted] + hoisted
    imports.sort(key=lambda t: not t.startswith("from __future__"))
    knob_lines = "\n".join(f"    {n} = {v!r}" for n, v in sorted(knobs_doc.items()))
    doc = (f'KernelArc candidate composed over the reference graph of {title} (kernelarc.graph).\n\n'
           f"Knobs:\n{knob_lines}\n\nSites:\n")  # fmt: skip
    for i, plan in enumerate(plans):
        for sp in plan.sites:
            doc += f"    case {i}: {sp.site.describe()} -> {sp.impl.value}{f' ({sp.part})' if sp.part else ''}\n"
    doc = '"""' + doc.replace('"""', "'''") + '"""'
    out = [doc, "", *imports, *bodies, ""]
    out.append(f"CUDA_GRAPH = {bool(k.cuda_graph)}")
    out.append(f"CUDA_GRAPH_MAX_BYTES = {CUDA_GRAPH_MAX_BYTES}")
    if k.matmul_precision != "highest":
        out.append(f"torch.set_float32_matmul_precision({k.matmul_precision!r})")
    if k.rest != "eager" and not k.trace_kernels:
        out += [f"{prefix}run = torch.compiler.disable({prefix}run)" for prefix in parts]
    elif traced:
        # traced calls need compiled Triton kernels: under Triton's interpreter (the CPU) dynamo would trace into
        # the interpreter and fail, so there the kernels' calls stay outside the graph as untraced
        out.append('if os.environ.get("TRITON_INTERPRET") == "1":')
        out += [f"    {prefix}run = torch.compiler.disable({prefix}run)" for prefix in parts]
    for i, plan in enumerate(plans):
        out += ["", ""] + emit_case(f"_case{i}", plan, {**knobs_doc, "sdpa_backend": k.sdpa_backend,
                                                          "attn_precision": k.attn_precision})  # fmt: skip
        out.append("")
        out.append(_compile_wrap(f"_case{i}", k))
    out += ["", ""]
    sigs = [f"    {sig!r}: _case{i}_fn," for i, p in enumerate(plans) for sig in p.case.signatures]
    out += ["_SIGNATURES = {", *sigs, "}"]
    # graphs traced with host-read inputs baked in, right for those values only: compared before they run
    vals = [f"    {sig!r}: {tuple(p.case.baked_values())!r}," for p in plans if p.case.specialized
            for sig in p.case.signatures]  # fmt: skip
    out += ["_VALUES = {", *vals, "}"]
    src = "\n".join(out) + RUNTIME
    try:
        compile_check(src)
    except SyntaxError as e:
        raise CompositionError(f"emitted source does not parse: {e}") from e
    return src


def compile_check(src: str) -> None:
    import ast

    ast.parse(src)
