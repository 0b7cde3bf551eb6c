"""GPU checks of the float32 split-precision GEMM family (kernelarc.families.matmul_f32) on tensor cores: each
precision's error against a float64 product stays in its class (the interpreter computes every precision in fp32,
so only the GPU shows them apart), on both paths (the operands' parts side by side, the split in the K loop),
transposed views, batched products and the split-K form for outputs of few tiles. The bounds are a few times what
run DF measured on the H200 (BENCHMARKS.md, fifteenth session)."""

from __future__ import annotations

import pytest
import torch

from kernelarc.families.matmul_f32 import SPLIT
from kernelarc.tasks.inputs import load_module

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# largest error over the largest |C| (DF, K of 1024 to 16384: bf16x3 2e-5, tf32x3 5e-5 with the parts, bf16x6 1e-4
# at K 16384, tf32 9e-4)
BOUND = {"bf16x3": 1e-4, "tf32x3": 2e-4, "bf16x6": 3e-4, "tf32": 3e-3}


def _case(shape_a, shape_b, transposed: bool, g: torch.Generator):
    if transposed:
        return (torch.randn(shape_a[::-1], generator=g, device="cuda").t(),
                torch.randn(shape_b[::-1], generator=g, device="cuda").t())  # fmt: skip
    return torch.randn(shape_a, generator=g, device="cuda"), torch.randn(shape_b, generator=g, device="cuda")


@pytest.mark.parametrize("algo", ["concat", "inline"])
@pytest.mark.parametrize("precision", list(BOUND))
def test_each_precision_keeps_its_error_class_on_tensor_cores(precision, algo):
    mod = load_module(SPLIT.render(SPLIT.check_point({"PRECISION": precision, "ALGO": algo})), f"f32gpu_{precision}")
    g = torch.Generator(device="cuda").manual_seed(0)
    cases = [
        _case((1000, 1024), (768, 1024), False, g),  # ragged M and N
        _case((512, 4096), (256, 4096), True, g),  # weight-gradient form: few output tiles, split K
        (torch.randn(6, 200, 96, generator=g, device="cuda"), torch.randn(6, 130, 96, generator=g, device="cuda")),
    ]
    for a, b in cases:
        got = mod.run(a, b)
        want = torch.matmul(a.double(), b.double().transpose(-1, -2))
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        # (the split precisions' bounds are below one TF32 product's 9e-4: a split that fell back to one product,
        # or lost its low parts, fails here)
        assert err < BOUND[precision], (precision, algo, tuple(a.shape), tuple(b.shape), err)
