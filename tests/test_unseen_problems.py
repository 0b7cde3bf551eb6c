"""Problems KernelArc had never seen, written for the purpose in SOL-ExecBench's native format (GroupNorm + SiLU,
cross-entropy with a scalar output, an MoE router, LayerNorm, causal conv1d, conv2d, embeddings, scans, ALiBi
attention written out, RMSNorm backward, per-token fp8 quantisation, scatter-add, a GPT-2 MLP, cosine similarity,
and edge cases: non-contiguous view outputs, an in-place reference, Gemma's 1 + weight, softmax over a middle dim,
SwiGLU with the gate second). None is from SOL-ExecBench. Each loads, its reference gives the definition's outputs
on the CPU, and its reference is captured and recognised as the search would (the suite over them found the
scalar-output, budget and CPU-shrink bugs fixed with this file)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernelarc.families.composed import composed_families, recognise
from kernelarc.graph.adapters import Impl
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

ROOT = Path(__file__).parent / "problems" / "unseen"
PROBLEMS = sorted(str(p.parent.relative_to(ROOT)) for p in ROOT.rglob("definition.json"))
# the site kinds the recognisers must find (substitutable by a family or a library call)
SITES = {
    "L1/103_moe_router_softmax_topk_renorm": {"softmax"},
    "L1/104_residual_add_layernorm_affine": {"fused"},  # aten.layer_norm: a fused region op
    "L1/116_qkv_projection_split_heads_transpose": {"gemm"},
    "L1/118_gemma_rmsnorm_one_plus_weight": {"rmsnorm"},
    "L1/120_swiglu_gate_second_half": {"glu"},
    "L1/121_llama_rope_view_as_complex": {"rope"},  # complex freqs on the RoPE kernels (their real / imag parts)
    "L1/123_key_padding_attention_einsum_masked_fill": {"attention"},
    "L2/113_gpt2_mlp_gelu_tanh_bias": {"gemm"},
}


def test_the_problems_are_there():
    assert len(PROBLEMS) == 26, PROBLEMS


@pytest.mark.parametrize("rel", PROBLEMS)
def test_an_unseen_problem_loads_runs_and_is_recognised(rel):
    task = load_task(ROOT / rel, cpu=True)
    ref = load_module(task.definition.reference, f"unseen_{task.name}")
    with torch.no_grad():
        out = ref.run(*make_inputs(task, 0, 0, "cpu"))
    outs = list(out.values()) if isinstance(out, dict) else list(out) if isinstance(out, tuple | list) else [out]
    assert len(outs) == len(task.definition.outputs)
    for (name, spec), o in zip(task.definition.outputs.items(), outs, strict=True):
        shape = task.shape(name, 0)
        if shape is None:  # a scalar: a Python number or a 0-d tensor (tests/guard/test_scalar_outputs.py)
            assert not isinstance(o, torch.Tensor) or o.dim() == 0, (name, o)
            continue
        assert tuple(o.shape) == tuple(shape) and str(o.dtype) == f"torch.{spec.dtype}", (name, o.shape, o.dtype)
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    found = {k.value for k in rec.kinds() if rec.substitutable(k, Impl.library) or rec.substitutable(k, Impl.family)}
    assert SITES.get(rel, set()) <= found, (rel, found)
    fams = composed_families(task)
    if rel == "L1/109_alibi_causal_attention_explicit":
        # known gap: a tensor the reference builds from Python data (the ALiBi slopes) is captured on the meta
        # device without its values, so no composition of the problem can be emitted (a warning says so)
        assert fams == []
    else:
        assert any(f.name.endswith(".library") for f in fams), [f.name for f in fams]
