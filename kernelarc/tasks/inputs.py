"""Deterministic input generation for a workload: the same (task, workload, seed, device)
always gives the same tensors, so the judge and an isolated worker can each build them."""

from __future__ import annotations

import math
import types
from pathlib import Path
from typing import Any

import torch

from kernelarc.tasks.loader import Task, TaskError

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64, "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2, "int64": torch.int64,
    "int32": torch.int32, "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}  # fmt: skip

# Random integer inputs (indices, positions) are drawn from [0, INT_HIGH).
INT_HIGH = 64


_MODULE_DIR: str | None = None


def load_module(source: str, name: str) -> types.ModuleType:
    """Import Python source as a module from a real file.

    Triton's JIT reads kernel source from the defining file and torch.compile looks the
    module up in ``sys.modules``, so the source is written to a private temp folder and
    imported under a unique name (content hash) registered in ``sys.modules``.
    """
    import hashlib
    import importlib.util
    import sys
    import tempfile

    global _MODULE_DIR
    if _MODULE_DIR is None:
        _MODULE_DIR = tempfile.mkdtemp(prefix="kernelarc-modules-")
    digest = hashlib.sha256(source.encode()).hexdigest()[:12]
    modname = f"kernelarc_{''.join(ch if ch.isalnum() else '_' for ch in name)}_{digest}"
    if modname in sys.modules:
        return sys.modules[modname]
    path = Path(_MODULE_DIR) / f"{modname}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(modname, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[modname] = mod
    try:
        spec.loader.exec_module(mod)
    except BaseException:
        sys.modules.pop(modname, None)
        raise
    return mod


def torch_dtype(name: str) -> torch.dtype:
    try:
        return TORCH_DTYPES[name]
    except KeyError:
        raise TaskError(f"dtype {name!r} is not supported for generated inputs") from None


def _random_tensor(shape: tuple[int, ...], dtype: str, gen: torch.Generator, device: torch.device) -> torch.Tensor:
    td = torch_dtype(dtype)
    if td.is_floating_point:
        return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(td)
    if td == torch.bool:
        return torch.rand(shape, generator=gen, device=device) < 0.5
    return torch.randint(0, INT_HIGH, shape, generator=gen, device=device, dtype=td)


def make_inputs(task: Task, index: int, seed: int, device: str | torch.device) -> list[Any]:
    """Inputs of workload ``index`` in definition order (scalars as Python values)."""
    device = torch.device(device)
    defn = task.definition
    wl = task.workloads[index]
    axes = task.axes(index)
    kinds = {d.type for d in wl.inputs.values()}
    if kinds == {"custom"}:
        return _custom_inputs(task, index, seed, device, axes)
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    values: list[Any] = []
    for name, spec in defn.inputs.items():
        desc = wl.inputs[name]
        shape = task.shape(name, index)
        if desc.type == "scalar":
            values.append(desc.value)
        elif desc.type == "random":
            values.append(_random_tensor(shape or (), spec.dtype, gen, device))
        elif desc.type == "safetensors":
            values.append(_safetensor(task, name, desc.path, desc.tensor_key, shape, spec.dtype, device))
        else:  # pragma: no cover - validated by the loader
            raise TaskError(f"input {name}: unsupported type {desc.type}")
    return values


def _safetensor(task: Task, name: str, rel: str, key: str, shape, dtype: str, device) -> torch.Tensor:
    from safetensors import safe_open

    path = Path(rel) if Path(rel).is_absolute() else task.path / rel
    if not path.is_file():
        raise TaskError(f"input {name}: safetensors file {path} not found")
    with safe_open(str(path), framework="pt", device="cpu") as f:
        if key not in f.keys():  # noqa: SIM118 - safe_open has no __contains__
            raise TaskError(f"input {name}: key {key!r} not in {path} (keys: {sorted(f.keys())})")
        t = f.get_tensor(key)
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise TaskError(f"input {name}: {path}[{key}] has shape {tuple(t.shape)}, expected {tuple(shape)}")
    if t.dtype != torch_dtype(dtype):
        raise TaskError(f"input {name}: {path}[{key}] has dtype {t.dtype}, expected {dtype}")
    return t.to(device)


def _custom_inputs(task: Task, index: int, seed: int, device: torch.device, axes: dict[str, int]) -> list[Any]:
    defn = task.definition
    mod = load_module(defn.reference, f"reference_{task.name}")
    fn = getattr(mod, defn.custom_inputs_entrypoint or "", None)
    if fn is None:
        raise TaskError(f"{task.path}: custom_inputs_entrypoint {defn.custom_inputs_entrypoint!r} not found")
    devices = [device.index] if device.type == "cuda" and device.index is not None else []
    with torch.random.fork_rng(devices=devices, enabled=True):
        torch.manual_seed(seed)
        produced = fn(dict(axes), device)
    missing = set(defn.inputs) - set(produced)
    if missing:
        raise TaskError(f"{task.path}: {defn.custom_inputs_entrypoint} did not produce inputs {sorted(missing)}")
    return [produced[n] for n in defn.inputs]


def input_bytes(task: Task, index: int) -> int:
    total = 0
    for name, spec in task.definition.inputs.items():
        shape = task.shape(name, index)
        if shape is not None:
            total += math.prod(shape) * torch_dtype(spec.dtype).itemsize
    return total
