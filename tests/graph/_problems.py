"""Small synthetic problems (definition + workloads in a temp folder) for the graph tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernelarc.tasks.loader import Task, load_task

# fused add + RMSNorm feeding a SwiGLU MLP (two recognised sites in one graph)
ADD_RMS_MLP = """
import torch
import torch.nn.functional as F

@torch.no_grad()
def run(x, res, w, wg, wu):
    s = x + res
    sf = s.to(torch.float32)
    n = (w * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + 1e-6))).to(x.dtype)
    h = F.silu(F.linear(n, wg)) * F.linear(n, wu)
    return h, s
"""


def make_task(
    root: Path,
    name: str,
    reference: str,
    inputs: dict[str, tuple[list[Any] | None, str]],
    outputs: dict[str, tuple[list[Any], str]],
    workloads: list[dict[str, int]],
    scalars: dict[str, Any] | None = None,
    tolerance: dict[str, float] | None = None,
) -> Task:
    """A problem folder with var axes named in the shapes; ``scalars`` give scalar inputs' values."""
    axes: dict[str, Any] = {}
    for shape, _ in list(inputs.values()) + list(outputs.values()):
        for a in shape or []:
            if isinstance(a, str):
                axes[a] = {"type": "var"}
    defn = {
        "name": name,
        "axes": axes,
        "inputs": {n: {"shape": s, "dtype": d} for n, (s, d) in inputs.items()},
        "outputs": {n: {"shape": s, "dtype": d} for n, (s, d) in outputs.items()},
        "reference": reference,
    }
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "definition.json").write_text(json.dumps(defn))
    lines = []
    for i, ax in enumerate(workloads):
        ins: dict[str, Any] = {}
        for n, (shape, _) in inputs.items():
            if shape is None:
                ins[n] = {"type": "scalar", "value": (scalars or {})[n]}
            else:
                ins[n] = {"type": "random"}
        wl: dict[str, Any] = {"uuid": f"w{i}", "axes": ax, "inputs": ins}
        if tolerance:
            wl["tolerance"] = tolerance
        lines.append(json.dumps(wl))
    (folder / "workload.jsonl").write_text("\n".join(lines) + "\n")
    return load_task(folder)
