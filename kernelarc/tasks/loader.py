"""Load and validate SOL-ExecBench problem folders; list the built-in tasks.

Errors name the file, the line (for workloads), the field and what was expected.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kernelarc.tasks.schema import (
    AxisConst,
    AxisExpr,
    AxisVar,
    Definition,
    Tolerance,
    Workload,
    eval_expr,
    is_literal_dim,
)

log = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).parent / "builtin"
CPU_WORKLOADS = "workload_cpu.jsonl"

# Per-dtype defaults when a workload gives no tolerance: (atol, rtol, required_matched_ratio).
DEFAULT_TOLERANCE: dict[str, tuple[float, float, float]] = {
    "float64": (1e-8, 1e-7, 1.0),
    "float32": (1e-4, 1e-4, 1.0),
    "float16": (1e-2, 1e-2, 1.0),
    "bfloat16": (2e-2, 2e-2, 1.0),
    "float8_e4m3fn": (1e-1, 1e-1, 0.99),
    "float8_e5m2": (2e-1, 2e-1, 0.99),
}
EXACT_TOLERANCE = (0.0, 0.0, 1.0)

DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "float4_e2m1": 0.5, "float4_e2m1fn_x2": 1, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "bool": 1,
}  # fmt: skip


class TaskError(ValueError):
    """A malformed or unknown task. The message says which file and field, and what was expected."""


def _fmt_validation(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        parts.append(f"field '{loc}': {e['msg']}")
    return "; ".join(parts)


@dataclass
class Task:
    """A problem: its definition, its workloads, and where it came from."""

    name: str
    path: Path
    definition: Definition
    workloads: list[Workload]
    metadata: dict[str, Any] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    workload_file: str = "workload.jsonl"

    @property
    def input_names(self) -> list[str]:
        return list(self.definition.inputs)

    @property
    def output_names(self) -> list[str]:
        return list(self.definition.outputs)

    def axes(self, index: int) -> dict[str, int]:
        return resolve_axes(self.definition, self.workloads[index].axes)

    def shape(self, tensor: str, index: int) -> tuple[int, ...] | None:
        spec = self.definition.inputs.get(tensor) or self.definition.outputs[tensor]
        if spec.shape is None:
            return None
        axes = self.axes(index)
        return tuple(int(a) if is_literal_dim(a) else axes[a] for a in spec.shape)

    def io_bytes(self, index: int) -> int:
        """Unique input plus output bytes of a workload (the roofline's minimum traffic)."""
        total = 0.0
        for name, spec in {**self.definition.inputs, **self.definition.outputs}.items():
            shape = self.shape(name, index)
            if shape is not None:
                total += math.prod(shape) * DTYPE_BYTES[spec.dtype]
        return int(total)

    def tolerance(self, index: int, output: str) -> tuple[float, float, float]:
        """(atol, rtol, required_matched_ratio) for one output of one workload."""
        dtype = self.definition.outputs[output].dtype
        atol, rtol, ratio = DEFAULT_TOLERANCE.get(dtype, EXACT_TOLERANCE)
        tol = self.workloads[index].tolerance
        if tol is not None:
            atol = tol.max_atol if tol.max_atol is not None else atol
            rtol = tol.max_rtol if tol.max_rtol is not None else rtol
            ratio = tol.required_matched_ratio if tol.required_matched_ratio is not None else ratio
        return atol, rtol, ratio


def resolve_axes(defn: Definition, given: dict[str, int]) -> dict[str, int]:
    """Values of every axis: const from the definition, var from the workload, expr computed."""
    values: dict[str, int] = {}
    for name, ax in defn.axes.items():
        if isinstance(ax, AxisConst):
            values[name] = ax.value
        elif isinstance(ax, AxisVar):
            if name not in given:
                raise TaskError(f"workload gives no value for var axis {name!r}")
            values[name] = int(given[name])
    pending = {n: a for n, a in defn.axes.items() if isinstance(a, AxisExpr)}
    while pending:
        progressed = False
        for name, ax in list(pending.items()):
            try:
                v = eval_expr(ax.expression, values)
            except ValueError:
                continue
            if isinstance(v, float):
                if not v.is_integer():
                    raise TaskError(f"expr axis {name!r} = {ax.expression} gives non-integer {v}")
                v = int(v)
            values[name] = v
            del pending[name]
            progressed = True
        if not progressed:
            raise TaskError(f"expr axes {sorted(pending)} cannot be resolved (cycle or unknown names)")
    for name, v in values.items():
        if v < 0:
            raise TaskError(f"axis {name!r} resolves to negative size {v}")
    for c in defn.constraints or []:
        if not eval_expr(c, values):
            raise TaskError(f"constraint {c!r} does not hold for axes {values}")
    return values


def _load_definition(path: Path) -> Definition:
    f = path / "definition.json"
    if not f.is_file():
        raise TaskError(f"{f}: file not found (a task folder needs definition.json and workload.jsonl)")
    try:
        raw = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise TaskError(f"{f}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(raw, dict):
        raise TaskError(f"{f}: expected a JSON object at the top level")
    try:
        return Definition.model_validate(raw)
    except ValidationError as e:
        raise TaskError(f"{f}: {_fmt_validation(e)}") from None


def _load_workloads(path: Path, defn: Definition, warnings: list[str]) -> list[Workload]:
    if not path.is_file():
        raise TaskError(f"{path}: file not found")
    out: list[Workload] = []
    misspelt = 0
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            raise TaskError(f"{where}: invalid JSON at column {e.colno}: {e.msg}") from None
        tol = raw.get("tolerance") if isinstance(raw, dict) else None
        if isinstance(tol, dict) and "required_match_ratio" in tol:
            # Real SOL-ExecBench data misspells the schema's required_matched_ratio.
            value = tol.pop("required_match_ratio")
            tol.setdefault("required_matched_ratio", value)
            misspelt += 1
        try:
            wl = Workload.model_validate(raw)
        except ValidationError as e:
            raise TaskError(f"{where}: {_fmt_validation(e)}") from None
        _check_workload(wl, defn, where)
        out.append(wl)
    if misspelt:
        msg = (
            f"{path}: {misspelt} workload(s) spell the tolerance key 'required_match_ratio'; "
            "read as the schema's 'required_matched_ratio'"
        )
        warnings.append(msg)
        log.warning(msg)
    if not out:
        raise TaskError(f"{path}: no workloads")
    return out


def _check_workload(wl: Workload, defn: Definition, where: str) -> None:
    var_axes = {n for n, a in defn.axes.items() if isinstance(a, AxisVar)}
    unknown = set(wl.axes) - set(defn.axes)
    if unknown:
        raise TaskError(f"{where}: field 'axes' names unknown axes {sorted(unknown)}; expected {sorted(var_axes)}")
    missing = var_axes - set(wl.axes)
    if missing:
        raise TaskError(f"{where}: field 'axes' lacks var axes {sorted(missing)}")
    for n in set(wl.axes) & set(defn.axes):
        ax = defn.axes[n]
        if isinstance(ax, AxisConst) and wl.axes[n] != ax.value:
            raise TaskError(f"{where}: field 'axes.{n}' is {wl.axes[n]}, but the axis is const {ax.value}")
    if set(wl.inputs) != set(defn.inputs):
        raise TaskError(
            f"{where}: field 'inputs' has {sorted(wl.inputs)}; expected exactly the definition's {sorted(defn.inputs)}"
        )
    kinds = {d.type for d in wl.inputs.values()}
    if "custom" in kinds:
        if kinds != {"custom"}:
            raise TaskError(f"{where}: field 'inputs': custom inputs cannot be mixed with {sorted(kinds - {'custom'})}")
        if not defn.custom_inputs_entrypoint:
            raise TaskError(f"{where}: custom inputs need 'custom_inputs_entrypoint' in definition.json")
    for name, d in wl.inputs.items():
        spec = defn.inputs[name]
        if d.type == "scalar" and spec.shape is not None:
            raise TaskError(f"{where}: field 'inputs.{name}': scalar value given for a tensor input")
        if d.type == "random" and spec.shape is None:
            raise TaskError(f"{where}: field 'inputs.{name}': a scalar input (shape null) needs type 'scalar'")
    try:
        resolve_axes(defn, wl.axes)
    except TaskError as e:
        raise TaskError(f"{where}: {e}") from None


def load_task(path: str | Path, *, workload_file: str | None = None, cpu: bool = False) -> Task:
    """Load a problem folder. With ``cpu=True`` prefer its tiny CPU workload set."""
    p = Path(path)
    if not p.is_dir():
        raise TaskError(f"{p}: task folder not found")
    defn = _load_definition(p)
    warnings: list[str] = []
    if workload_file is None:
        workload_file = CPU_WORKLOADS if cpu and (p / CPU_WORKLOADS).is_file() else "workload.jsonl"
    workloads = _load_workloads(p / workload_file, defn, warnings)
    meta_file = p / "metadata.json"
    metadata = {}
    if meta_file.is_file():
        try:
            metadata = json.loads(meta_file.read_text())
        except json.JSONDecodeError as e:
            warnings.append(f"{meta_file}: ignored, invalid JSON ({e.msg})")
    return Task(defn.name, p, defn, workloads, metadata, warnings, workload_file)


def builtin_tasks() -> list[str]:
    return sorted(d.name for d in BUILTIN_DIR.iterdir() if (d / "definition.json").is_file())


def load_builtin(name: str, *, cpu: bool = False) -> Task:
    if name not in builtin_tasks():
        raise TaskError(f"unknown task {name!r}; built-in tasks: {', '.join(builtin_tasks())} (or sol_execbench)")
    return load_task(BUILTIN_DIR / name, cpu=cpu)


def tolerance_from(tol: Tolerance | None) -> dict[str, float | None]:
    return tol.model_dump() if tol else {}
