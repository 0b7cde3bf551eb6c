"""Export a kernel out of KernelArc.

- ``sol-execbench``: ``solution.json`` in the Solution schema of NVIDIA's harness
  (``../shared/sol-execbench-harness/docs/solution.md`` and its pydantic model
  ``sol_execbench.core.data.solution.Solution``): name, definition, description, author,
  spec {languages, target_hardware, entry_point, destination_passing_style, dependencies},
  sources [{path, content}], with the sources also written beside it.
  Destination-passing style (the schema's default) is ours too: ``main.py::run`` takes the
  inputs, then the preallocated outputs, and returns nothing; it calls the candidate (which
  returns its outputs, KernelArc's convention) kept unchanged in ``kernelarc_kernel.py`` and
  copies the results into the destinations. ``dps=False`` exports the value-returning module
  alone as ``main.py`` (``destination_passing_style: false``).
- ``python``: one standalone module ``<name>.py`` with a provenance header comment.
"""

from __future__ import annotations

import ast
import json
import keyword
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
KERNEL_MODULE = "kernelarc_kernel"  # the candidate's own module under DPS (a name no package uses)
KERNEL_FILE = f"{KERNEL_MODULE}.py"
AUTHOR = "kernelarc"
# Values SOL-ExecBench's own Solution model accepts for target_hardware (enum SupportedHardware).
SOL_HARDWARE = ("B200", "LOCAL")
# The schema's spec.languages enum (SupportedLanguages); Python ones may not be mixed with C++ ones.
SOL_LANGUAGES = ("pytorch", "triton", "cute_dsl", "cutile", "cudnn_frontend", "cutlass", "cudnn", "cublas", "cuda_cpp")
# Our language -> the schema's languages. A KernelArc CUTLASS candidate is a Python module that
# builds its C++ with nvcc and calls it through ctypes: its entry point is Python, so it is a
# "pytorch" solution to the harness (the schema's "cutlass" means a C++ entry file it compiles).
_SPEC_LANGUAGES = {"triton": ["triton"], "pytorch": ["pytorch"], "cutlass": ["pytorch"]}
_DEPENDENCIES = {"triton": ["torch", "triton"], "pytorch": ["torch"], "cutlass": ["torch", "nvidia-cutlass"]}


def _imports_triton(source: str) -> bool:
    return re.search(r"^\s*(import triton|from triton\b)", source, re.MULTILINE) is not None


def _dependencies(candidate: Candidate) -> list[str]:
    """The language's packages, plus triton for a module that imports it under another language
    (a shape dispatch over CUTLASS and Triton parts is language ``cutlass``)."""
    deps = list(_DEPENDENCIES[candidate.language])
    if _imports_triton(candidate.source) and "triton" not in deps:
        deps.append("triton")
    return deps


def spec_languages(candidate: Candidate) -> list[str]:
    """``spec.languages`` for a candidate: the schema's enum values (see ``SOL_LANGUAGES``)."""
    langs = list(_SPEC_LANGUAGES[candidate.language])
    if _imports_triton(candidate.source) and "triton" not in langs:
        langs.append("triton")
    return langs


def _param_names(names: Sequence[str]) -> bool:
    """True when every name can be a Python parameter of the DPS entry point."""
    reserved = {"torch", "_kernel_run", "_store", "_OUTPUTS", "_INPUTS"}
    return all(n.isidentifier() and not keyword.iskeyword(n) and n not in reserved for n in names) and len(
        set(names)
    ) == len(names)


def dps_entry(input_names: Sequence[str], output_names: Sequence[str]) -> str:
    """``main.py`` of a DPS export: ``run(<inputs>, <outputs>)`` calls the value-returning kernel
    and copies its results into the preallocated outputs, with the checks the harness applies to
    a value-returning solution (count, shape, dtype), so a wrong result is not hidden by
    broadcasting or casting in ``copy_``. Parameters are named as in the definition (the
    schema's rule) when the names are identifiers, else positional."""
    ins, outs = list(input_names), list(output_names)
    if not outs:
        raise ValueError("a destination-passing export needs the definition's output names")
    if _param_names(ins + outs):
        params = ", ".join(ins + outs)
        call = f"_kernel_run({', '.join(ins)})"
        dests = f"[{', '.join(outs)}]"
    else:
        params = "*args"
        call = "_kernel_run(*args[: len(_INPUTS)])"
        dests = "list(args[len(_INPUTS) :])"
    return f'''"""SOL-ExecBench entry point, destination-passing style: the inputs, then the preallocated
outputs; returns nothing. The kernel (KernelArc's value-returning candidate, unchanged) lives in
{KERNEL_FILE}; its results are copied into the outputs."""

import torch

from {KERNEL_MODULE} import run as _kernel_run

_INPUTS = {tuple(ins)!r}
_OUTPUTS = {tuple(outs)!r}


def run({params}):
    _store({call}, {dests})


def _store(result, dests):
    if len(dests) != len(_OUTPUTS):
        raise TypeError(f"expected {{len(_INPUTS)}} inputs and {{len(_OUTPUTS)}} outputs {{_OUTPUTS}}")
    if isinstance(result, dict):
        values = [result[name] for name in _OUTPUTS]
    elif isinstance(result, (tuple, list)):
        values = list(result)
    else:
        values = [result]
    if len(values) != len(dests):
        raise RuntimeError(f"the kernel returned {{len(values)}} outputs, {{len(dests)}} expected {{_OUTPUTS}}")
    for name, dst, val in zip(_OUTPUTS, dests, values):
        if not isinstance(val, torch.Tensor):
            val = torch.tensor(val, dtype=dst.dtype, device=dst.device)
        if tuple(val.shape) != tuple(dst.shape):
            got, want = tuple(val.shape), tuple(dst.shape)
            raise RuntimeError(f"output {{name}}: the kernel returned shape {{got}}, expected {{want}}")
        if val.dtype != dst.dtype:
            raise RuntimeError(f"output {{name}}: the kernel returned {{val.dtype}}, expected {{dst.dtype}}")
        dst.copy_(val)
'''


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


_IMPORT_TORCH = re.compile(r"^import torch[ \t]*$", re.MULTILINE)
# torch.compile in any spelling (a call, a decorator, ``from torch import compile``) or Dynamo / Inductor
# used directly: all of them reach Inductor's compile pool on the GPU.
_COMPILES = re.compile(r"\btorch\.compile\b|\bfrom torch import\b[^\n]*\bcompile\b|\btorch\._(?:dynamo|inductor)\b")
_FUTURE = re.compile(r"^from __future__ import [^\n]*\n", re.MULTILINE)
INDUCTOR_IN_PROCESS = (
    "import torch._inductor.config as _kernelarc_inductor_config\n\n"
    "# Inductor compiles in this process, as KernelArc's guard judged it: with its default pool, the first\n"
    "# Triton compile starts a sidecar process whose timer thread (subproc_worker_timer) appears seconds\n"
    "# later, during NVIDIA's harness's later calls: 'Thread injection detected' (REWARD_HACK) otherwise\n"
    "_kernelarc_inductor_config.compile_threads = 1\n"
    "# Inductor builds a disabled tqdm progress bar per compile where tqdm is installed; tqdm's first instance\n"
    "# starts its monitor thread (tqdm_monitor), which a compile after NVIDIA's first call would add to its\n"
    "# count: started here, at import, it is there before every count\n"
    "try:\n"
    "    from tqdm import tqdm as _kernelarc_tqdm\n"
    "except ImportError:\n"
    "    pass\n"
    "else:\n"
    "    _kernelarc_tqdm(disable=True).close()\n"
)


def _inductor_in_process(source: str) -> str:
    """A solution that uses torch.compile compiles in-process (``compile_threads = 1``, set before its
    first compile): with Inductor's default pool, the first Triton compile creates a sidecar process and
    submits a readiness job; the answer arrives seconds later and starts the pool's timer thread, during
    the calls NVIDIA's harness counts threads across (seen on the H200: two composed champions judged
    REWARD_HACK, '4 threads after call vs 3 before'). With one compile thread Inductor never creates the
    pool (``AsyncCompile.warm_pool`` / ``use_process_pool`` return early), so no thread starts lazily."""
    if not _COMPILES.search(source):
        return source
    m = _IMPORT_TORCH.search(source)
    if m is not None:
        return source[: m.end()] + "\n" + INDUCTOR_IN_PROCESS + source[m.end() :]
    # no plain ``import torch`` line (``import torch.nn as nn``, ``from torch import ...``): first thing
    # after the __future__ imports, which must stay first
    futures = list(_FUTURE.finditer(source))
    at = futures[-1].end() if futures else 0
    return source[:at] + INDUCTOR_IN_PROCESS + "\n" + source[at:]


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
    dps: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
) -> Path:
    """Write the candidate to ``out_dir``; returns ``solution.json`` or the module path.

    ``dps`` (sol-execbench only, the schema's default): the entry point takes the inputs and the
    preallocated outputs (``input_names`` and ``output_names``, the definition's, in its order,
    are then required). ``metrics`` (latency_ms, speedup_vs_baseline, ...) and ``provenance``
    (run id, model version, gpu, software versions) go into the python header and, for
    sol-execbench, into a ``kernelarc.json`` sidecar (the Solution schema has no field for them).
    """
    hardware = _validate(candidate, task_definition_name, fmt, target_hardware)
    definition = task_definition_name.strip()
    if fmt == "sol-execbench" and dps and not output_names:
        raise ValueError("a destination-passing export needs output_names (the definition's outputs), or dps=False")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(f"out_dir {out} exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    sol_name = _slug(name) if name else _slug(f"{definition}_{candidate.language}_kernelarc_{candidate.id[:8]}")
    source = _inductor_in_process(_self_contained(scrub_text(candidate.source)))
    if not source.endswith("\n"):
        source += "\n"
    description = description or candidate.rationale or f"KernelArc {candidate.language} kernel for {definition}"

    if fmt == "python":
        path = out / f"{sol_name}.py"
        path.write_text(_header(candidate, definition, description, hardware, metrics, provenance) + source)
        return path

    if dps:
        files = {ENTRY_FILE: dps_entry(input_names or [], output_names or []), KERNEL_FILE: source}
    else:
        files = {ENTRY_FILE: source}
    solution = {
        "name": sol_name,
        "definition": definition,
        "description": scrub_text(description),
        "author": AUTHOR,
        "spec": {
            "languages": spec_languages(candidate),
            "target_hardware": hardware,
            "entry_point": ENTRY_POINT,
            "destination_passing_style": bool(dps),
            "dependencies": list(dependencies) if dependencies is not None else _dependencies(candidate),
        },
        "sources": [{"path": k, "content": v} for k, v in files.items()],
    }
    path = out / "solution.json"
    path.write_text(json.dumps(solution, indent=2) + "\n")
    for stale in (ENTRY_FILE, KERNEL_FILE):  # a re-export in the other style leaves no stray module
        if stale not in files:
            (out / stale).unlink(missing_ok=True)
    for fname, text in files.items():
        (out / fname).write_text(text)
    if metrics or provenance:
        side = {"candidate": candidate.model_dump(mode="json", exclude={"source"}) | {"id": candidate.id}}
        side["metrics"] = dict(metrics or {})
        side["provenance"] = dict(provenance or {})
        (out / "kernelarc.json").write_text(scrub_text(json.dumps(side, indent=2, sort_keys=True, default=str)) + "\n")
    return path


def export_for_task(
    candidate: Candidate,
    task: Any,
    out_dir: str | Path,
    fmt: str = "sol-execbench",
    gpu: str = "local",
    *,
    dps: bool = True,
    description: str | None = None,
    metrics: Mapping[str, Any] | None = None,
    provenance: Mapping[str, Any] | None = None,
) -> Path:
    """``export_solution`` for a loaded task (``kernelarc.tasks.loader.Task``): its definition's
    name, input and output names, and the harness's hardware name for ``gpu``."""
    return export_solution(
        candidate, task.definition.name, out_dir, fmt, sol_target_hardware(gpu), description,
        metrics=metrics, provenance=provenance, dps=dps, input_names=task.input_names,
        output_names=task.output_names,
    )  # fmt: skip
