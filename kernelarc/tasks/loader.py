"""Load and validate SOL-ExecBench problem folders; list the built-in tasks.

Errors name the file, the line (for workloads), the field and what was expected.
"""

from __future__ import annotations

import hashlib
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

# Defaults of NVIDIA's harness (ToleranceSpec) for a workload without a tolerance or a field of it:
# (max_atol, max_rtol, required_matched_ratio), the same for every output dtype (integers and booleans are
# compared in float32 under the same bounds). Kept identical so that our verdicts are the harness's.
DEFAULT_TOLERANCE = (1e-2, 1e-2, 0.99)
MISSPELT_RATIO = "required_match_ratio"


@dataclass(frozen=True)
class ToleranceRule:
    """The complete rule for one output of one workload (see kernelarc.guard.compare)."""

    atol: float
    rtol: float
    ratio: float
    max_error_cap: float | None = None
    allow_negative_inf: bool = False


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
        r = self.tolerance_rule(index, output)
        return r.atol, r.rtol, r.ratio

    def tolerance_rule(self, index: int, output: str) -> ToleranceRule:
        """The workload's tolerance with NVIDIA's defaults for what it leaves out (the same for every output)."""
        if output not in self.definition.outputs:
            raise TaskError(f"{self.path}: no output {output!r} (outputs: {self.output_names})")
        atol, rtol, ratio = DEFAULT_TOLERANCE
        tol = self.workloads[index].tolerance
        if tol is None:
            return ToleranceRule(atol, rtol, ratio)
        return ToleranceRule(
            tol.max_atol if tol.max_atol is not None else atol,
            tol.max_rtol if tol.max_rtol is not None else rtol,
            tol.required_matched_ratio if tol.required_matched_ratio is not None else ratio,
            tol.max_error_cap,
            bool(tol.allow_negative_inf),
        )


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
        try:
            wl = Workload.model_validate(raw)
        except ValidationError as e:
            raise TaskError(f"{where}: {_fmt_validation(e)}") from None
        extra = sorted((wl.tolerance.model_extra or {}) if wl.tolerance is not None else {})
        if MISSPELT_RATIO in extra:
            # Real SOL-ExecBench data misspells required_matched_ratio; NVIDIA's harness ignores the key
            # (its ToleranceSpec drops unknown fields), so the default ratio applies there, and here.
            misspelt += 1
            extra.remove(MISSPELT_RATIO)
        if extra:
            msg = f"{where}: tolerance keys {extra} are not NVIDIA's ToleranceSpec fields; ignored, as it does"
            warnings.append(msg)
            log.info(msg)
        _check_workload(wl, defn, where)
        out.append(wl)
    if misspelt:
        msg = (
            f"{path}: {misspelt} workload(s) spell the tolerance key '{MISSPELT_RATIO}'; NVIDIA's harness "
            f"ignores it, so the default required_matched_ratio {DEFAULT_TOLERANCE[2]} applies, as there"
        )
        warnings.append(msg)
        log.info(msg)  # in task.warnings; a guard worker reloading the task would only print it again
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
    """Load a problem folder. With ``cpu=True`` prefer its tiny CPU workload set. The task keeps the folder's
    absolute path: the guard's workers load it again from their own working folder (a relative
    ``task.path=../shared/...`` failed every evaluation there with "task folder not found")."""
    p = Path(path).resolve()
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


# On the CPU a workload moves at most this many input + output bytes; larger ones are shrunk.
CPU_MAX_IO_BYTES = 32 << 20


def _shrunk_axes(task: Task, index: int, max_io_bytes: int) -> tuple[dict[str, int], float]:
    """Var-axis values for workload ``index`` that keep the definition's constraints and move at most
    ``max_io_bytes`` where possible: the largest var axis that can be halved (constraints and expr axes
    still hold, and the halving saves at least a tenth of the bytes or reaches the bound) is halved until
    the workload fits or none can be. Returns the axes and their bytes."""
    defn = task.definition
    given = dict(task.workloads[index].axes)
    var = [n for n, a in defn.axes.items() if isinstance(a, AxisVar)]

    def io(axes: dict[str, int]) -> float:
        values = resolve_axes(defn, axes)
        total = 0.0
        for spec in (*defn.inputs.values(), *defn.outputs.values()):
            if spec.shape is not None:
                dims = [int(a) if is_literal_dim(a) else values[a] for a in spec.shape]
                total += math.prod(dims) * DTYPE_BYTES[spec.dtype]
        return total

    size = io(given)
    while size > max_io_bytes:
        for name in sorted(var, key=lambda n: -given[n]):
            if given[name] < 2:
                continue
            trial = {**given, name: given[name] // 2}
            try:
                trial_size = io(trial)
            except (TaskError, ValueError, ZeroDivisionError):
                continue
            if trial_size > max_io_bytes and trial_size > 0.9 * size:
                # a halving that saves under a tenth: const-shaped inputs hold the bytes, and halving on would
                # only collapse the var axes (a 64 MB embedding table took every workload to 1 x 1)
                continue
            given, size = trial, trial_size
            break
        else:
            break
    return given, size


def _reference_disagrees(task: Task, wl: Workload) -> str | None:
    """Why the reference does not produce the definition's outputs on workload ``wl`` (run once on the CPU),
    or None."""
    from kernelarc.tasks.inputs import load_module, make_inputs

    t = Task(task.name, task.path, task.definition, [wl], task.metadata, [], task.workload_file)
    try:
        out = load_module(task.definition.reference, f"reference_{task.name}").run(*make_inputs(t, 0, 0, "cpu"))
    except Exception as e:  # noqa: BLE001 - a reference that fails on the smaller shapes keeps its workload
        return f"make the reference fail ({type(e).__name__}: {str(e)[:200]})"
    outs = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, tuple | list) else [out]
    for name, o in zip(t.output_names, outs, strict=False):
        want = t.shape(name, 0)
        got = tuple(getattr(o, "shape", ()))
        if want is not None and got != tuple(want):
            return f"give the reference output {name} the shape {got}, not the definition's {tuple(want)}"
    return None


def fit_workloads(task: Task, max_io_bytes: int = CPU_MAX_IO_BYTES) -> Task:
    """The task with every workload above ``max_io_bytes`` shrunk (var axes halved within the definition's
    constraints), each with a warning; where the const axes alone exceed the bound it is shrunk as far as
    the constraints allow (the warning says so); a workload with safetensors inputs (fixed shapes) stays.
    Workload indices are unchanged.

    The shrunk set is written to a workload file of its own (an absolute ``workload_file``), so that a guard
    worker loading the task by path sees the same workloads.
    """
    import tempfile

    changed = False
    workloads = []
    warnings = list(task.warnings)
    for i, wl in enumerate(task.workloads):
        if task.io_bytes(i) <= max_io_bytes:
            workloads.append(wl)
            continue
        mb = task.io_bytes(i) / 2**20
        if any(d.type == "safetensors" for d in wl.inputs.values()):
            axes, size = dict(wl.axes), float(task.io_bytes(i))
        else:
            axes, size = _shrunk_axes(task, i, max_io_bytes)
        if axes == dict(wl.axes):
            safetensors = any(d.type == "safetensors" for d in wl.inputs.values())
            why = (
                "safetensors inputs have fixed shapes"
                if safetensors
                else "no var axis can shrink by a useful share (const-shaped inputs hold its bytes, or constraints)"
            )
            msg = f"{task.name}: workload {i} ({mb:.0f} MB) cannot be shrunk for the CPU: {why}"
            workloads.append(wl)
        else:
            was = {k: v for k, v in wl.axes.items() if axes[k] != v}
            now = {k: axes[k] for k in was}
            trial = wl.model_copy(update={"axes": axes, "uuid": f"{wl.uuid}~cpu"})
            broken = _reference_disagrees(task, trial)
            if broken:
                # Axes tied by the reference itself (a conv's output length, ...) but not by the definition.
                msg = f"{task.name}: workload {i} ({mb:.0f} MB) cannot be shrunk for the CPU: {was} -> {now} {broken}"
                warnings.append(msg)
                log.warning(msg)
                workloads.append(wl)
                continue
            msg = (
                f"{task.name}: workload {i} ({mb:.0f} MB) shrunk for the CPU to {size / 2**20:.1f} MB: "
                f"axes {was} -> {now}"
            )
            if size > max_io_bytes:
                msg += f"; still above {max_io_bytes / 2**20:.0f} MB (const axes or constraints)"
            workloads.append(trial)
            changed = True
        warnings.append(msg)
        log.warning(msg)
    if not changed:
        return Task(task.name, task.path, task.definition, task.workloads, task.metadata, warnings, task.workload_file)
    text = "".join(wl.model_dump_json(exclude_none=True) + "\n" for wl in workloads)
    digest = hashlib.sha256(f"{task.path.resolve()}\n{text}".encode()).hexdigest()[:12]
    tmp = Path(tempfile.gettempdir()) / f"kernelarc-{task.name}-cpu-{digest}.jsonl"
    if not tmp.is_file() or tmp.read_text() != text:
        tmp.write_text(text)
    return Task(task.name, task.path, task.definition, workloads, task.metadata, warnings, str(tmp))


def builtin_tasks() -> list[str]:
    return sorted(d.name for d in BUILTIN_DIR.iterdir() if (d / "definition.json").is_file())


def load_builtin(name: str, *, cpu: bool = False) -> Task:
    if name not in builtin_tasks():
        raise TaskError(f"unknown task {name!r}; built-in tasks: {', '.join(builtin_tasks())} (or sol_execbench)")
    return load_task(BUILTIN_DIR / name, cpu=cpu)


def tolerance_from(tol: Tolerance | None) -> dict[str, float | None]:
    return tol.model_dump() if tol else {}
