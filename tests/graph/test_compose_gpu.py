"""GPU checks of the composed candidates' graph-level knobs: CUDA-graph replay on fresh inputs,
Inductor for the rest, SDPA backends (cuDNN included), the family kernels compiled for sm_90."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from shared_dirs import SKIP_REASON, shared_path

from kernelarc.families import families_for
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

SOL = shared_path("sol-execbench")  # ../shared beside the checkout, or .shared/ on the GPU machine
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not SOL.is_dir(), reason=f"sol-execbench {SKIP_REASON}")]


def _outs(x):
    return list(x) if isinstance(x, tuple | list) else [x]


def _run_twice(task, fam_suffix: str, knobs: dict, workloads=(0, 1)) -> None:
    fam = next(f for f in families_for(task) if f.name.endswith(fam_suffix))
    src = fam.render(fam.check_point(knobs))
    mod = load_module(src, f"gpu_{task.name}")
    ref = load_module(task.definition.reference, f"gpu_ref_{task.name}")
    for i in workloads:
        held = []
        for seed in (1, 2, 3):  # fresh inputs each call: a replayed graph must not return stale results
            args = make_inputs(task, i, seed, "cuda")
            got, want = _outs(mod.run(*args)), _outs(ref.run(*args))
            held.append((got, want))
        for got, want in held:  # outputs a caller keeps are not overwritten by later calls
            for g, w in zip(got, want, strict=True):
                torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cuda_graph", [False, True])
@pytest.mark.parametrize("rest", ["eager", "inductor"])
def test_rmsnorm_problem_family_under_graph_knobs(cuda_graph, rest):
    task = load_task(SOL / "FlashInfer-Bench" / "024_rmsnorm_h2048")
    _run_twice(task, "rmsnorm.rowblock", {"cuda_graph": cuda_graph, "rest": rest})


@pytest.mark.parametrize("backend", ["auto", "flash", "efficient", "cudnn", "math"])
def test_builtin_style_attention_on_sdpa_backends(tmp_path, backend):
    import sys

    sys.path.insert(0, str(Path(__file__).parent))
    from _problems import make_task
    from test_compose import ATTN

    shapes = {"q": (["B", "H", "S", "D"], "bfloat16"), "k": (["B", "H", "S", "D"], "bfloat16"),
              "v": (["B", "H", "S", "D"], "bfloat16"), "causal": (None, "int32")}  # fmt: skip
    wls = [{"B": 2, "H": 4, "S": 256, "D": 64}, {"B": 1, "H": 8, "S": 512, "D": 128}]
    task = make_task(tmp_path, "g_attn", ATTN, shapes, {"o": (["B", "H", "S", "D"], "bfloat16")}, wls,
                     scalars={"causal": 1})  # fmt: skip
    _run_twice(task, "library", {"sdpa_backend": backend, "attn_precision": "low"})
    _run_twice(task, "attention.flash", {"cuda_graph": True})


def test_gemm_problem_on_each_matmul_family():
    task = load_task(SOL / "FlashInfer-Bench" / "004_gemm_n128_k2048")
    for name in ("matmul.tiled", "matmul.persistent_tma", "matmul.splitk"):
        _run_twice(task, name, {}, workloads=(0, 4))


def test_large_input_problem_replays_cuda_graphs_read_in_place():
    """L2/059's decoder layer at batch 1 (630-920 MB of inputs, mostly weights): CUDA-graph replay without copying the
    inputs, one graph per buffer set; new content in the same buffers (as the judge refills its timing sets) gives new
    results, and outputs a caller keeps are not overwritten."""
    task = load_task(SOL / "L2" / "059_decoder_layer_full_block")
    fam = next(f for f in families_for(task) if f.name.endswith("library"))
    mod = load_module(fam.render(fam.check_point({"cuda_graph": True, "rest": "inductor"})), "gpu_bound_graphs")
    ref = load_module(task.definition.reference, "gpu_bound_graphs_ref")
    sets = [make_inputs(task, 0, seed, "cuda") for seed in (1, 2)]
    assert sum(t.nbytes for t in sets[0] if isinstance(t, torch.Tensor)) > mod.CUDA_GRAPH_MAX_BYTES
    held = []
    for k in range(6):
        args = sets[k % 2]
        if k >= 4:  # new content in place: the same addresses, so the captured graphs replay on it
            for t in args:
                if isinstance(t, torch.Tensor) and t.is_floating_point():
                    t.copy_(t.roll(1, -1))
        got, want = _outs(mod.run(*args)), _outs(ref.run(*args))
        held.append((got, [w.clone() for w in want]))
    assert mod._BOUND and sum(len(c) for c in mod._BOUND.values()) == 2, mod._BOUND.keys()
    for got, want in held:
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g.float(), w.float(), atol=3e-2, rtol=3e-2)
