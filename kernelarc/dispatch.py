"""Shape dispatch: one candidate that routes each workload to the kernel fastest on it.

A task usually has several workloads (GEMM shapes, sequence lengths, row widths), and the
fastest family point for one is rarely the fastest for all: a 128x256 CUTLASS tile wins
the large square GEMM, a torch.compile template the LLM MLP shape. A single champion must
compromise. Here the session takes, for each workload, the correct candidate measured
fastest on it, and composes their sources into one module whose ``run`` looks up the
input signature (tensor shapes and dtypes, scalar values) and calls that part; shapes not
seen in the task go to the part with the best geomean. The composite is an ordinary
candidate: the guard checks it on fresh inputs and times it against the champion, so the
per-workload figures it was planned from (measured in different calls) are never trusted.

Composition is textual and keeps each part readable: every module-level name a part
binds is prefixed (``_p0_``, ``_p1_``, ...) everywhere it refers to that binding (scopes are
respected: a kernel parameter named like a module constant stays as it is), imports are
hoisted and de-duplicated, and nothing is ``exec``'d, so the static checks see all code.
"""

from __future__ import annotations

import ast
import math
import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from kernelarc.guard.decision import noise_bar
from kernelarc.models import Candidate, Verdict
from kernelarc.tasks.loader import Task

AGENT = "dispatch"
FAMILY = "dispatch"


class CompositionError(ValueError):
    """The parts cannot be combined into one module (a name clash, an unsupported construct)."""


# -- signatures -----------------------------------------------------------------------------
SIGNATURE_SRC = """
def _kernelarc_signature(args):
    # tensors by shape and dtype, other arguments by value
    return tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a) for a in args)
"""


def input_signature(args: Sequence[Any]) -> tuple:
    """The signature the composite computes at run time (same expression as SIGNATURE_SRC)."""
    import torch

    return tuple((tuple(a.shape), str(a.dtype)) if isinstance(a, torch.Tensor) else repr(a) for a in args)


def workload_signature(task: Task, index: int) -> tuple:
    """The signature of workload ``index``'s inputs, from the definition (no tensors are built)
    unless the task generates its inputs with a custom function: then on meta tensors, or on the CPU where
    the generator needs real data and its inputs are small (``capture.example_inputs``; CaptureError
    otherwise). On the H200, L2/024's 16 GB of inputs built on the CPU for this held its session past the
    suite's end."""
    from kernelarc.tasks.inputs import torch_dtype

    wl = task.workloads[index]
    if {d.type for d in wl.inputs.values()} == {"custom"}:
        from kernelarc.graph.capture import example_inputs

        return input_signature(example_inputs(task, index))
    out: list[Any] = []
    for name, spec in task.definition.inputs.items():
        desc = wl.inputs[name]
        if desc.type == "scalar":
            out.append(repr(desc.value))
        else:
            out.append((tuple(task.shape(name, index) or ()), str(torch_dtype(spec.dtype))))
    return tuple(out)


# -- renaming -------------------------------------------------------------------------------
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)
_COMPREHENSIONS = (ast.ListComp, ast.SetComp, ast.GeneratorExp, ast.DictComp)


def _walk_scope(nodes: Sequence[ast.AST]):
    """Nodes of one scope: does not descend into nested functions, lambdas, classes or
    comprehensions (it yields those nodes themselves)."""
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, _SCOPES + _COMPREHENSIONS):
            continue
        stack.extend(reversed(list(ast.iter_child_nodes(node))))


def _bound(nodes: Sequence[ast.AST]) -> set[str]:
    """Names a block of statements binds in its own scope."""
    names: set[str] = set()
    for n in _walk_scope(nodes):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store | ast.Del):
            names.add(n.id)
        elif isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(n.name)
        elif isinstance(n, ast.Import | ast.ImportFrom):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            names.add(n.name)
    return names


def _declared_global(body: Sequence[ast.AST]) -> set[str]:
    return {name for n in _walk_scope(body) if isinstance(n, ast.Global) for name in n.names}


def _all_args(args: ast.arguments) -> list[ast.arg]:
    return args.posonlyargs + args.args + args.kwonlyargs + [a for a in (args.vararg, args.kwarg) if a]


def _arg_names(args: ast.arguments) -> set[str]:
    return {a.arg for a in _all_args(args)}


class _Renamer(ast.NodeVisitor):
    """Collects the source spans of references to module-level names, scope-aware."""

    def __init__(self, targets: set[str], prefix: str, lines: list[bytes]):
        self.targets = targets
        self.prefix = prefix
        self.lines = lines
        # enclosing scopes' local names, innermost last; (is a class body, names)
        self.scopes: list[tuple[bool, set[str]]] = []
        self.edits: list[tuple[int, int, int, str]] = []  # (line index, start byte, end byte, new text)

    def _visible(self, name: str) -> bool:
        if name not in self.targets:
            return False
        last = len(self.scopes) - 1
        # a class body's names are visible in the body itself, not in functions nested in it
        return not any(name in names and (not is_class or i == last) for i, (is_class, names) in enumerate(self.scopes))

    def _edit(self, lineno: int, start: int, end: int, name: str) -> None:
        if self.lines[lineno - 1][start:end] != name.encode():  # positions must point at the name itself
            raise CompositionError(f"cannot locate {name!r} on line {lineno}")
        self.edits.append((lineno - 1, start, end, self.prefix + name))

    def _name_after(self, node: ast.AST, keyword: str, name: str) -> None:
        line = self.lines[node.lineno - 1]
        m = re.compile(rb"\b" + keyword.encode() + rb"\s+(" + re.escape(name.encode()) + rb")\b").search(
            line, node.col_offset
        )
        if m is None:
            raise CompositionError(f"cannot locate the name of {keyword} {name} on line {node.lineno}")
        self._edit(node.lineno, m.start(1), m.end(1), name)

    def visit_Name(self, node: ast.Name) -> None:
        if self._visible(node.id):
            self._edit(node.lineno, node.col_offset, node.end_col_offset, node.id)

    def visit_Global(self, node: ast.Global) -> None:
        if node.lineno != node.end_lineno:
            raise CompositionError(f"multi-line global statement on line {node.lineno}")
        line = self.lines[node.lineno - 1]
        for name in node.names:
            if name in self.targets:
                for m in re.finditer(rb"\b" + re.escape(name.encode()) + rb"\b", line[: node.end_col_offset]):
                    if m.start() >= node.col_offset:
                        self._edit(node.lineno, m.start(), m.end(), name)

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        args = node.args
        # decorators, defaults and annotations are evaluated in the enclosing scope
        for d in getattr(node, "decorator_list", []):
            self.visit(d)
        for d in args.defaults + [d for d in args.kw_defaults if d is not None]:
            self.visit(d)
        for a in _all_args(args):
            if a.annotation is not None:
                self.visit(a.annotation)
        if getattr(node, "returns", None) is not None:
            self.visit(node.returns)
        if not isinstance(node, ast.Lambda):
            if not self.scopes and node.name in self.targets:
                self._name_after(node, "def", node.name)
            local = (_arg_names(args) | _bound(node.body)) - _declared_global(node.body)
            body = node.body
        else:
            local = _arg_names(args)
            body = [node.body]
        self.scopes.append((False, local))
        for stmt in body:
            self.visit(stmt)
        self.scopes.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function
    visit_Lambda = _function

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        for n in node.decorator_list + node.bases + [k.value for k in node.keywords]:
            self.visit(n)
        if not self.scopes and node.name in self.targets:
            self._name_after(node, "class", node.name)
        self.scopes.append((True, _bound(node.body)))
        for stmt in node.body:
            self.visit(stmt)
        self.scopes.pop()

    def _comprehension(self, node) -> None:
        local: set[str] = set()
        for gen in node.generators:
            local |= {n.id for n in ast.walk(gen.target) if isinstance(n, ast.Name)}
        self.scopes.append((False, local))
        self.generic_visit(node)
        self.scopes.pop()

    visit_ListComp = _comprehension
    visit_SetComp = _comprehension
    visit_GeneratorExp = _comprehension
    visit_DictComp = _comprehension


@dataclass
class Part:
    """One part's source after renaming, with the imports taken out of it."""

    body: str
    imports: list[tuple[str, dict[str, str]]]  # (statement text, {name it binds: what it binds it to})
    names: set[str]  # the part's module-level names after renaming


def import_binds(node: ast.Import | ast.ImportFrom) -> dict[str, str]:
    """What each name an import statement binds refers to: ``import torch.nn.functional`` binds
    ``torch`` to the package ``torch``, as ``import torch`` does, so the two agree."""
    if isinstance(node, ast.Import):
        return {a.asname or a.name.split(".")[0]: a.name if a.asname else a.name.split(".")[0] for a in node.names}
    mod = "." * node.level + (node.module or "")
    return {a.asname or a.name: f"{mod}:{a.name}" for a in node.names}


def rename_part(source: str, prefix: str) -> Part:
    """Prefix every module-level binding of ``source`` (and each reference to it); hoist its
    top-level imports and drop its module docstring."""
    tree = ast.parse(source)
    lines = source.encode().splitlines(keepends=True)
    drop: set[int] = set()  # 0-based line indexes removed from the body
    imports: list[tuple[str, set[str]]] = []
    spans: list[tuple[int, int]] = []
    for node in tree.body:
        spans.append((node.lineno, node.end_lineno or node.lineno))
    for i, node in enumerate(tree.body):
        hoist = isinstance(node, ast.Import | ast.ImportFrom)
        docstring = i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if not (hoist or docstring):
            continue
        lo, hi = spans[i]
        if any(j != i and not (end < lo or start > hi) for j, (start, end) in enumerate(spans)):
            raise CompositionError(f"statement on line {lo} shares its line with another statement")
        drop.update(range(lo - 1, hi))
        if hoist:
            imports.append((ast.unparse(node), import_binds(node)))
    rest = [n for i, n in enumerate(tree.body) if not isinstance(n, ast.Import | ast.ImportFrom)]
    for n in rest:  # (_walk_scope does not enter functions: imports there are local and fine)
        for sub in _walk_scope([n]):
            if sub is not n and isinstance(sub, ast.Import | ast.ImportFrom):
                raise CompositionError(f"import nested in a module-level block (line {sub.lineno}) is not supported")
    targets = _bound(rest)
    renamer = _Renamer(targets, prefix, lines)
    for n in rest:
        renamer.visit(n)
    by_line: dict[int, list[tuple[int, int, str]]] = {}
    for li, s, e, new in renamer.edits:
        by_line.setdefault(li, []).append((s, e, new))
    out: list[bytes] = []
    for li, line in enumerate(lines):
        if li in drop:
            continue
        for s, e, new in sorted(set(by_line.get(li, [])), reverse=True):
            line = line[:s] + new.encode() + line[e:]
        out.append(line)
    body = b"".join(out).decode().strip("\n") + "\n"
    return Part(body=body, imports=imports, names={prefix + t for t in targets})


# -- composition ----------------------------------------------------------------------------
@dataclass
class Route:
    candidate: Candidate
    workloads: list[int]  # workload indexes this part serves
    signatures: list[tuple]  # their input signatures
    latency_ms: list[float]  # its measured latency on each


def compose(routes: Sequence[Route], default: Candidate, axes: dict[int, dict[str, int]] | None = None) -> str:
    """One module whose ``run`` dispatches each route's signatures to its candidate and any
    other input to ``default`` (which may also serve routes)."""
    cands: list[Candidate] = []
    for c in [default] + [r.candidate for r in routes]:
        if all(c.id != x.id for x in cands):
            cands.append(c)
    if len(cands) < 2:
        raise CompositionError("a dispatch needs at least two different kernels")
    # (a baseline part is the reference's own source, whose ``if __name__ == "__main__":`` demo block the guard's
    # static check rejects in a candidate: Quant/003's dispatch on the H200 was rejected_hack for it)
    from kernelarc.graph.compose import drop_main_guard

    parts = [rename_part(drop_main_guard(c.source), f"_p{i}_") for i, c in enumerate(cands)]
    hoisted: dict[str, tuple[str, str]] = {}  # bound name -> (what it refers to, the first statement binding it)
    order: list[str] = []
    for p in parts:
        for text, names in p.imports:
            for n, what in names.items():
                first = hoisted.setdefault(n, (what, text))
                if first[0] != what:
                    raise CompositionError(f"parts import different things as {n!r}: {first[1]!r} vs {text!r}")
            if text not in order:
                order.append(text)
    if "torch" not in hoisted:
        order.append("import torch")
    own = {"run", "_ROUTES", "_kernelarc_signature"}
    seen: set[str] = set(hoisted) | own
    for p in parts:
        clash = p.names & seen
        if clash:
            raise CompositionError(f"module-level names clash after renaming: {sorted(clash)}")
        seen |= p.names
    for i, p in enumerate(parts):
        if f"_p{i}_run" not in p.names:
            raise CompositionError(f"part {i} ({cands[i].family or cands[i].id}) defines no run()")
    order.sort(key=lambda t: not t.startswith("from __future__"))
    index = {c.id: i for i, c in enumerate(cands)}
    doc = ["KernelArc candidate: shape dispatch over searched kernels (built by kernelarc.dispatch).", "", "Parts:"]
    for i, c in enumerate(cands):
        knobs = ", ".join(f"{k}={v}" for k, v in sorted(c.knobs.items()))
        doc.append(f"  part {i}: candidate {c.id} ({c.family or c.language}) {knobs}".rstrip())
    doc += ["", "Routes (workload: part, its latency drift-corrected to the session's first measurement):"]
    for r in routes:
        for w, ms in zip(r.workloads, r.latency_ms, strict=True):
            shape = ", ".join(f"{k}={v}" for k, v in (axes or {}).get(w, {}).items())
            doc.append(f"  workload {w}{f' ({shape})' if shape else ''}: part {index[r.candidate.id]}, {ms:.4f} ms")
    doc.append("  any other input: part 0 (best geomean over all workloads)")
    text = ['"""' + "\n".join(doc).replace('"""', "'''") + '\n"""', "", *order, ""]
    for i, (c, p) in enumerate(zip(cands, parts, strict=True)):
        text += ["", f"# ---- part {i}: candidate {c.id} ({c.family or c.language}) " + "-" * 20, "", p.body]
    text += ["", SIGNATURE_SRC.strip("\n"), "", "", "_ROUTES = {"]
    for r in routes:
        for sig in r.signatures:
            text.append(f"    {sig!r}: _p{index[r.candidate.id]}_run,")
    text += ["}", "", "", "def run(*args):", "    return _ROUTES.get(_kernelarc_signature(args), _p0_run)(*args)", ""]
    source = "\n".join(text)
    ast.parse(source)  # a composition bug surfaces here, not in the guard
    return source


def composite_language(cands: Sequence[Candidate]) -> str:
    langs = {c.language for c in cands}
    return "cutlass" if "cutlass" in langs else "triton" if "triton" in langs else "pytorch"


# -- planning -------------------------------------------------------------------------------
@dataclass
class Plan:
    routes: list[Route]
    default: Candidate
    predicted_ms: float  # geomean over workloads of the chosen parts' latencies
    champion_ms: float

    @property
    def key(self) -> tuple:
        return (self.default.id, *sorted((r.candidate.id, tuple(r.workloads)) for r in self.routes))


def _geomean(xs: Sequence[float]) -> float:
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def geomean_over(per: dict[int, float], workloads) -> float | None:
    """Geomean of ``per`` over ``workloads``; None unless every one has a positive latency."""
    xs = [per.get(i) for i in workloads]
    return _geomean(xs) if xs and all(x and x > 0 for x in xs) else None


def drift_corrected(
    history: Sequence[tuple[Candidate, Verdict, str | None]],
    max_drift: float = 1.5,
) -> dict[str, dict[int, float]]:
    """Per-workload latencies of every timed candidate, on one time base.

    ``history``: (candidate, verdict, id of the champion it was timed against) in measurement
    order. A GPU's speed drifts over a session (clocks under sustained load), so latencies
    timed minutes apart do not compare. Every candidate is timed interleaved with the champion
    of its moment, though, so its latency relative to that champion is drift-free; chaining
    those ratios from the first measurement (the reference baseline) puts all candidates on
    that measurement's time base: corrected = latency * corrected(champion) / champion's
    interleaved latency. Without an interleaved champion figure, or where the champion beside the
    candidate ran more than ``max_drift`` times off its own figure (then something other than
    drift is at work: the guard's consistency rule voids such comparisons too), the raw latency
    is used.
    """
    out: dict[str, dict[int, float]] = {}
    for c, v, champ_id in history:
        base = out.get(champ_id or "")
        per: dict[int, float] = {}
        for w in v.workloads:
            if not w.latency_ms:
                continue
            drift = float(w.champion_ms) / base[w.index] if base and w.champion_ms and base.get(w.index) else None
            if drift and 1.0 / max_drift <= drift <= max_drift:
                per[w.index] = float(w.latency_ms) / drift
            else:
                per[w.index] = float(w.latency_ms)
        if per and c.id not in out:
            out[c.id] = per
    return out


def plan(
    pool: Sequence[tuple[Candidate, dict[int, float]]],
    signatures: dict[int, tuple],
    champion_ms: float | None,
    min_gain: float,
    route_margin: float = 0.0,
    exclude: Collection[tuple[str, int]] = (),
    champion_id: str | None = None,
) -> Plan | None:
    """The dispatch worth trying now, or None.

    ``pool``: correct candidates (composites are skipped as parts) with their per-workload
    latencies (see ``drift_corrected``); only those timed on every workload can be parts.
    ``signatures``: workload index -> input signature; workloads with the same signature are
    one group and share a part. ``champion_ms``: the champion's geomean on the same time base.
    A group leaves the default part (the champion, ``champion_id``, when it is one of the parts,
    else the best geomean over all workloads) only for a kernel
    more than ``route_margin`` faster on it, so a near-tie stays with one kernel. ``exclude`` holds
    (candidate id, workload) routes an earlier dispatch measured slower than the champion beside it
    (see ``failed_routes``): such a kernel is no part for that workload's group. A plan is
    offered only when it uses at least two kernels and the geomean of each workload's chosen
    latency beats ``champion_ms`` by more than ``min_gain``.
    """
    wls = sorted(signatures)
    if len(wls) < 2 or not champion_ms:
        return None
    parts = [(c, per) for c, per in pool if c.family != FAMILY and all(per.get(i) for i in wls)]
    if len(parts) < 2:
        return None
    groups: dict[tuple, list[int]] = {}
    for i in wls:
        groups.setdefault(signatures[i], []).append(i)
    if len(groups) < 2:
        return None
    incumbent = next((p for p in parts if champion_id and p[0].id == champion_id), None)
    default, default_lat = incumbent or min(parts, key=lambda p: _geomean([p[1][i] for i in wls]))
    chosen: dict[str, Route] = {}
    best: dict[int, float] = {}
    for sig, idx in groups.items():
        allowed = [p for p in parts if not any((p[0].id, i) in exclude for i in idx)] or [(default, default_lat)]
        c, lat = min(allowed, key=lambda p: _geomean([p[1][i] for i in idx]))
        if _geomean([lat[i] for i in idx]) * (1.0 + route_margin) > _geomean([default_lat[i] for i in idx]):
            c, lat = default, default_lat
        r = chosen.setdefault(c.id, Route(c, [], [], []))
        r.workloads += idx
        r.signatures.append(sig)
        r.latency_ms += [lat[i] for i in idx]
        best.update({i: lat[i] for i in idx})
    if len(chosen) < 2:
        return None
    predicted = _geomean([best[i] for i in wls])
    if predicted > champion_ms * (1.0 - min_gain):
        return None
    return Plan(routes=list(chosen.values()), default=default, predicted_ms=predicted, champion_ms=champion_ms)


def failed_routes(
    history: Sequence[tuple[Candidate, Verdict, str | None]], min_gain: float, noise_factor: float = 1.0
) -> set[tuple[str, int]]:
    """(part id, workload) routes that a judged dispatch ran slower than the champion beside it, by
    more than the guard's bar for that workload (``1 + max(min_gain, noise_factor * noise)``).

    A plan's routes come from latencies measured minutes apart, corrected for drift through
    chained ratios; a dispatch is then timed interleaved with the champion, which is the better
    figure. A route that lost there is dropped from later plans, so the next plan keeps what
    held up instead of repeating the wrong route in every composition.
    """
    bad: set[tuple[str, int]] = set()
    for c, v, champ_id in history:
        if c.family != FAMILY or not v.correct:
            continue
        for w in v.workloads:
            part = c.knobs.get(f"workload{w.index}")
            if not part or part == champ_id or not w.latency_ms or not w.champion_ms:
                continue
            if float(w.champion_ms) / float(w.latency_ms) < 1.0 / noise_bar(w.noise or 0.0, min_gain, noise_factor):
                bad.add((str(part), w.index))
    return bad


def build_candidate(p: Plan, axes: dict[int, dict[str, int]] | None = None) -> Candidate:
    source = compose(p.routes, p.default, axes)
    parts = [p.default] + [r.candidate for r in p.routes if r.candidate.id != p.default.id]
    knobs = {f"workload{w}": r.candidate.id for r in p.routes for w in r.workloads}
    knobs["default"] = p.default.id
    return Candidate(
        source=source,
        language=composite_language(parts),
        agent=AGENT,
        strategy="algorithmic",
        family=FAMILY,
        knobs=dict(sorted(knobs.items())),
        parent=p.default.id,
        rationale=(
            f"shape dispatch over {len(parts)} kernels: best measured per workload, "
            f"predicted {p.predicted_ms:.4g} ms geomean vs champion {p.champion_ms:.4g} ms"
        ),
    )
