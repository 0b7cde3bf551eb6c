"""Export a kernel out of KernelArc.

- ``sol-execbench``: ``solution.json`` in the SOL-ExecBench Solution schema (docs/solution.md:
  name, definition, description, author, spec {language, target_hardware, entry_point,
  destination_passing_style, dependencies}, sources [{path, content}]) plus ``main.py``
  beside it. Candidates follow the value-returning convention, hence
  ``destination_passing_style: false``.
- ``python``: one standalone module ``<name>.py`` with a provenance header comment.
"""

from __future__ import annotations

import ast
import json
import logging
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kernelarc.models import LANGUAGES, Candidate
from kernelarc.tracking import scrub_text

log = logging.getLogger(__name__)

FORMATS = ("sol-execbench", "python")
ENTRY_FILE = "main.py"
ENTRY_POINT = f"{ENTRY_FILE}::run"
AUTHOR = "kernelarc"
# Values SOL-ExecBench's own Solution model accepts for target_hardware.
SOL_HARDWARE = ("B200", "LOCAL")
# Our language -> the schema's spec.language. A CUTLASS candidate is a Python module that
# builds and calls CUTLASS, so its entry point is Python.
_SPEC_LANGUAGE = {"triton": "triton", "pytorch": "python", "cutlass": "python"}
_DEPENDENCIES = {"triton": ["torch", "triton"], "pytorch": ["torch"], "cutlass": ["torch", "nvidia-cutlass"]}


def _dependencies(candidate: Candidate) -> list[str]:
    """The language's packages, plus triton for a module that imports it under another language
    (a shape dispatch over CUTLASS and Triton parts is language ``cutlass``)."""
    deps = list(_DEPENDENCIES[candidate.language])
    imports_triton = re.search(r"^\s*(import triton|from triton\b)", candidate.source, re.MULTILINE)
    if imports_triton and "triton" not in deps:
        deps.append("triton")
    return deps


def sol_target_hardware(gpu: str) -> list[str]:
    """SOL-ExecBench's hardware names for one of our gpu config values."""
    return ["B200"] if gpu.lower() == "b200" else ["LOCAL"]


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_]+", "_", text).strip("_")
    return slug or "kernel"


def _defines_run(source: str) -> bool:
    """True when the module binds a top-level ``run`` (def, assignment or import)."""
    tree = ast.parse(source)
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "run":
            return True
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "run" for t in node.targets):
            return True
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "run":
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == "run" for a in node.names):
            return True
    return False


def _validate(candidate: Any, definition: Any, fmt: Any, target_hardware: Any) -> list[str]:
    if not isinstance(candidate, Candidate):
        raise TypeError(f"candidate must be a kernelarc.models.Candidate, got {type(candidate).__name__}")
    if candidate.language not in LANGUAGES:
        raise ValueError(f"candidate language {candidate.language!r} is not one of {LANGUAGES}")
    if not candidate.source.strip():
        raise ValueError("candidate source is empty")
    try:
        has_run = _defines_run(candidate.source)
    except SyntaxError as exc:
        raise ValueError(f"candidate source does not parse: line {exc.lineno}: {exc.msg}") from exc
    if not has_run:
        raise ValueError("candidate source defines no top-level `run` (the entry point main.py::run)")
    if not isinstance(definition, str) or not definition.strip():
        raise ValueError(f"task_definition_name must be a non-empty string, got {definition!r}")
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r}: expected one of {FORMATS}")
    if isinstance(target_hardware, str):
        target_hardware = [target_hardware]
    if not isinstance(target_hardware, Sequence) or not target_hardware:
        raise ValueError(f"target_hardware must be a non-empty list of strings, got {target_hardware!r}")
    hw = []
    for item in target_hardware:
        if not isinstance(item, str) or not item.strip():
            raise ValueError(f"target_hardware entries must be non-empty strings, got {item!r}")
        hw.append(item.strip())
    unknown = [h for h in hw if h not in SOL_HARDWARE]
    if fmt == "sol-execbench" and unknown:
        log.warning("target_hardware %s is outside SOL-ExecBench's accepted values %s", unknown, SOL_HARDWARE)
    return hw


CUTLASS_IMPORT = "from kernelarc import cutlass as _cutlass"


def _self_contained(source: str) -> str:
    """CUTLASS candidates build through ``kernelarc.cutlass``; an exported solution must not need
    KernelArc installed, so the helper is inlined as a module object in its place."""
    if CUTLASS_IMPORT not in source:
        return source
    from kernelarc import cutlass as helper

    helper_src = Path(helper.__file__).read_text().replace("from __future__ import annotations\n", "")
    inline = (
        "import types as _types\n\n"
        f"_CUTLASS_HELPER_SRC = {helper_src!r}\n"
        '_cutlass = _types.ModuleType("kernelarc_cutlass_inlined")\n'
        "exec(compile(_CUTLASS_HELPER_SRC, 'kernelarc/cutlass.py', 'exec'), _cutlass.__dict__)\n"
    )
    return source.replace(CUTLASS_IMPORT, inline, 1)


def _header(
    candidate: Candidate,
    definition: str,
    description: str | None,
    hardware: list[str],
    metrics: Mapping[str, Any] | None,
    provenance: Mapping[str, Any] | None,
) -> str:
    lines = [
        "KernelArc export",
        f"task definition: {definition}",
        f"candidate: {candidate.id}  language: {candidate.language}",
        f"agent: {candidate.agent}  strategy: {candidate.strategy}",
    ]
    if candidate.family:
        lines.append(f"family: {candidate.family}  knobs: {json.dumps(candidate.knobs, sort_keys=True, default=str)}")
    if candidate.parent:
        lines.append(f"parent: {candidate.parent}")
    lines.append(f"target hardware: {', '.join(hardware)}")
    if description:
        lines.append(f"description: {description}")
    if candidate.rationale:
        lines.append(f"rationale: {candidate.rationale}")
    for title, data in (("metrics", metrics), ("provenance", provenance)):
        if data:
            lines.append(f"{title}:")
            lines.extend(f"  {k}: {v}" for k, v in data.items() if v is not None)
    lines.append(f"exported: {time.strftime('%Y-%m-%dT%H:%M:%S%z')}")
    lines.append("entry point: run(*inputs) -> outputs (value-returning)")
    # Comments only, so a `from __future__` import in the source stays legal.
    body = "\n".join("# " + line.replace("\n", " ") if line else "#" for line in lines)
    return scrub_text(body) + "\n\n"


def export_solution(
    candidate: Candidate,
    task_definition_name: str,
    out_dir: str | Path,
    fmt: str = "sol-execbench",
    target_hardware: Sequence[str] | str = ("LOCAL",),
    description: str | None = None,
    *,
    name: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
    dependencies: Sequence[str] | None = None,
) -> Path:
    """Write the candidate to ``out_dir``; returns ``solution.json`` or the module path.

    ``metrics`` (latency_ms, speedup_vs_baseline, ...) and ``provenance`` (run id, model
    version, gpu, software versions) go into the python header and, for sol-execbench, into a
    ``kernelarc.json`` sidecar (the Solution schema has no field for them).
    """
    hardware = _validate(candidate, task_definition_name, fmt, target_hardware)
    definition = task_definition_name.strip()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    sol_name = _slug(name) if name else _slug(f"{definition}_{candidate.language}_kernelarc_{candidate.id[:8]}")
    source = _self_contained(scrub_text(candidate.source))
    if not source.endswith("\n"):
        source += "\n"
    description = description or candidate.rationale or f"KernelArc {candidate.language} kernel for {definition}"

    if fmt == "python":
        path = out / f"{sol_name}.py"
        path.write_text(_header(candidate, definition, description, hardware, metrics, provenance) + source)
        return path

    solution = {
        "name": sol_name,
        "definition": definition,
        "description": scrub_text(description),
        "author": AUTHOR,
        "spec": {
            "language": _SPEC_LANGUAGE[candidate.language],
            "target_hardware": hardware,
            "entry_point": ENTRY_POINT,
            "destination_passing_style": False,
            "dependencies": list(dependencies) if dependencies is not None else _dependencies(candidate),
        },
        "sources": [{"path": ENTRY_FILE, "content": source}],
    }
    path = out / "solution.json"
    path.write_text(json.dumps(solution, indent=2) + "\n")
    (out / ENTRY_FILE).write_text(source)
    if metrics or provenance:
        side = {"candidate": candidate.model_dump(mode="json", exclude={"source"}) | {"id": candidate.id}}
        side["metrics"] = dict(metrics or {})
        side["provenance"] = dict(provenance or {})
        (out / "kernelarc.json").write_text(scrub_text(json.dumps(side, indent=2, sort_keys=True, default=str)) + "\n")
    return path
