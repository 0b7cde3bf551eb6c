"""Small synthetic problems (definition + workloads in a temp folder) for the graph tests."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kernelarc.tasks.loader import Task, load_task


def spied_family_module(task: Task, family_suffix: str, knobs: dict | None = None, *, start: bool = False,
                        name: str = "spy") -> tuple[Any, list[int]]:  # fmt: skip
    """The composed candidate of the family whose name ends in ``family_suffix``, rendered at its check
    point for ``knobs`` (``start``: at its start point) and loaded, with its family kernel (``_k0_run``)
    wrapped by a counter that calls through: the list grows by one per kernel call, so a silent fallback to
    the graph's own ops leaves it empty. The case functions read that module global at call time."""
    from kernelarc.families import families_for
    from kernelarc.guard.static import check_source
    from kernelarc.tasks.inputs import load_module

    fam = next(f for f in families_for(task) if f.name.endswith(family_suffix))
    src = fam.render(fam.start if start else fam.check_point(knobs or {}))
    assert check_source(src).ok
    mod = load_module(src, f"{name}_{task.name}")
    calls: list[int] = []
    real = mod._k0_run

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    mod._k0_run = counted
    return mod, calls


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

# a tanh-gated residual's backward (L1/061's form): a scalar gate, a row mask, a full sum
GATED = """
import torch

@torch.no_grad()
def run(g, gate, h, mask):
    t = torch.tanh(gate.to(torch.float32))
    dh = g * t * mask
    dgate = torch.sum(g.to(torch.float32) * (h * mask).to(torch.float32)) * (1.0 - t * t)
    return g.clone(), dh.to(torch.bfloat16), dgate.to(torch.bfloat16)
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
