"""MLflow pyfunc loader of a registered KernelArc kernel.

Every registered version's folder is an MLflow model whose ``python_function`` flavor names this
module as its loader; the registry copies this file into the model's ``code/`` folder (MLflow puts
that folder on ``sys.path`` before importing the loader), so loading needs torch (and Triton or the
CUTLASS helper where the kernel uses them) but not KernelArc itself. It imports only the standard
library: torch comes in with the kernel.

    model = mlflow.pyfunc.load_model("models:/kernelarc.rmsnorm.h200@champion")
    y = model.predict([x, weight])          # the inputs in definition order, torch tensors
    y = model.predict({"x": x, "weight": weight})
"""

from __future__ import annotations

import importlib.util
import json
import uuid
from pathlib import Path
from typing import Any

DEFINITION_FILE = "definition.json"


class KernelModel:
    """The kernel's ``run(*inputs)`` behind MLflow's ``predict(model_input)``."""

    def __init__(self, kernel_path: str | Path):
        self.path = Path(kernel_path)
        if not self.path.is_file():
            raise FileNotFoundError(f"kernel source {self.path} not found in the model folder")
        defn = self.path.parent / DEFINITION_FILE
        definition = json.loads(defn.read_text()) if defn.is_file() else {}
        self.input_names: list[str] = list(definition.get("inputs", {}))
        self.output_names: list[str] = list(definition.get("outputs", {}))
        # A unique module name: two versions loaded in one process must not share a module.
        spec = importlib.util.spec_from_file_location(f"kernelarc_model_{uuid.uuid4().hex}", self.path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {self.path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        run = getattr(module, "run", None)
        if not callable(run):
            raise ImportError(f"{self.path} defines no run(*inputs)")
        self.run = run

    def _arguments(self, model_input: Any) -> list[Any]:
        if isinstance(model_input, dict):
            missing = [n for n in self.input_names if n not in model_input]
            extra = [n for n in model_input if n not in self.input_names]
            if not self.input_names or missing or extra:
                raise ValueError(
                    f"inputs by name must be exactly {self.input_names}; missing {missing}, unexpected {extra}"
                )
            return [model_input[n] for n in self.input_names]
        args = list(model_input) if isinstance(model_input, (list, tuple)) else [model_input]
        if self.input_names and len(args) != len(self.input_names):
            raise ValueError(f"expected {len(self.input_names)} inputs {self.input_names}, got {len(args)}")
        return args

    def predict(self, model_input: Any, params: dict[str, Any] | None = None) -> Any:
        """The kernel's outputs (one tensor, or a tuple in definition order) for the inputs."""
        return self.run(*self._arguments(model_input))


def _load_pyfunc(data_path: str) -> KernelModel:
    """MLflow's loader hook: ``data_path`` is the model's ``kernel.py``."""
    return KernelModel(data_path)
