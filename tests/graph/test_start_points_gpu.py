"""GPU check of the first candidates a tiny budget measures on real problems: every start point of
``composed.start_points`` (kernel families with the rest under Inductor, the library family, CUDA-graph
replay) builds, runs and matches the reference on fresh inputs.

    python3 -m pytest -q tests/graph/test_start_points_gpu.py   (H200: a few minutes, mostly Inductor compiles)
"""

from __future__ import annotations

import pytest
import torch
from shared_dirs import SKIP_REASON, shared_path

from kernelarc.families import families_for
from kernelarc.families.composed import start_points
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

SOL = shared_path("sol-execbench")  # ../shared beside the checkout, or .shared/ on the GPU machine
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not SOL.is_dir(), reason=f"sol-execbench {SKIP_REASON}"),
]


def _outs(x):
    return list(x) if isinstance(x, tuple | list) else [x]


@pytest.mark.parametrize(
    "problem",
    [
        "L1/054_audio_attention_qkv_projection_with_normalization",
        "L1/085_geglu_activation",
        "L2/041_kv_shared_attention_with_dual_rope",
        "L1/021_vision_cu_seqlens_variable_length_attention",
    ],
)
def test_start_points_run_and_match_the_reference(problem):
    task = load_task(SOL / problem)
    seeds = start_points(task, families_for(task))[:4]
    assert seeds
    ref = load_module(task.definition.reference, f"gpu_sp_ref_{task.name}")
    for n, (fam, point) in enumerate(seeds):
        mod = load_module(fam.render(point), f"gpu_sp_{task.name}_{n}")
        for i in (0, 1):
            for seed in (1, 2):
                args = make_inputs(task, i, seed, "cuda")
                got, want = _outs(mod.run(*args)), _outs(ref.run(*args))
                for g, w in zip(got, want, strict=True):
                    wl = task.workloads[i]
                    tol = wl.tolerance.max_atol if wl.tolerance and wl.tolerance.max_atol else 2e-2
                    scale = max(1.0, w.float().abs().max().item())
                    torch.testing.assert_close(g.float(), w.float(), atol=max(tol, 1e-5) * scale, rtol=2e-2,
                                               msg=lambda m, f=fam.name, p=point: f"{f} {p}: {m}")  # fmt: skip
