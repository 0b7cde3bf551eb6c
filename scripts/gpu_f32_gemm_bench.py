"""float32 GEMMs on the GPU: cuBLAS SGEMM (what the fp32 references and torch.compile run), cuBLAS TF32, and points of
the split-precision family ``matmul_f32.split``, on shapes of the fp32 SOL-ExecBench problems.

    python3 scripts/gpu_f32_gemm_bench.py [--quick]

Each shape is timed with ``triton.testing.do_bench`` (median, L2 flushed) in one process; operands are drawn from
N(0, 1) (never zeros). The error columns are against a float64 product of the same operands: the largest error
over the largest |C|, and the share of elements within atol + rtol * |C| for two tolerances of the fp32 problems
(L1/072: 2.2e-4 + 1e-3 |C|; L1/054: 1.9e-3 + 1e-5 |C|). A table goes to stdout last.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelarc.families.matmul_f32 import SPLIT  # noqa: E402
from kernelarc.tasks.inputs import load_module  # noqa: E402

# (name, A shape or transposed-view spec, B [N, K] spec): "t" marks an operand read as a transposed view
SHAPES = [
    ("L1/072 dX 16384x1024x1024", (16384, 1024), False, (1024, 1024), True),  # grad @ W (W [K, N] read as W^T^T)
    ("L1/072 dW 1024x1024x16384", (1024, 16384), True, (1024, 16384), True),  # grad^T @ X, both transposed views
    ("L2/030 768x3072x3072", (768, 3072), False, (3072, 3072), False),
    ("L1/054 512x1024x1024", (512, 1024), False, (1024, 1024), False),
    ("L1/089 ~4096x512x512", (4096, 512), False, (512, 512), False),
]
BATCHED = [("L1/001 QK^T 320x256x256x128", (320, 256, 128), (320, 256, 128))]
POINTS = [
    {"PRECISION": "tf32x3"},
    {"PRECISION": "bf16x6"},
    {"PRECISION": "bf16x3"},
    {"PRECISION": "tf32"},
    {"PRECISION": "bf16x6", "BLOCK_K": 64},
    {"PRECISION": "bf16x6", "BLOCK_K": 64, "BLOCK_N": 256, "num_stages": 2},
    {"PRECISION": "tf32x3", "ALGO": "inline"},
]
TOLS = ((2.2e-4, 1e-3), (1.9e-3, 1e-5))


def operand(shape: tuple[int, int], transposed: bool, g: torch.Generator) -> torch.Tensor:
    if transposed:  # stored as its transpose, read through a view
        return torch.randn(shape[::-1], generator=g, device="cuda").t()
    return torch.randn(shape, generator=g, device="cuda")


def errors(c: torch.Tensor, ref: torch.Tensor) -> str:
    d = (c.double() - ref).abs()
    within = [(d <= a + r * ref.abs()).double().mean().item() for a, r in TOLS]
    return f"{d.max().item() / ref.abs().max().item():.1e} | {within[0]:.4f} | {within[1]:.4f}"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first four points only")
    args = ap.parse_args()
    from triton.testing import do_bench

    points = POINTS[:4] if args.quick else POINTS
    mods = []
    for i, p in enumerate(points):
        knobs = SPLIT.check_point(p)
        if not SPLIT.valid(knobs):
            print(f"point {p} is not valid; skipped", flush=True)
            continue
        mods.append((p, load_module(SPLIT.render(knobs), f"f32bench{i}")))
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    cases = [(n, operand(sa, ta, g), operand(sb, tb, g)) for n, sa, ta, sb, tb in SHAPES]
    cases += [(n, torch.randn(sa, generator=g, device="cuda"), torch.randn(sb, generator=g, device="cuda"))
              for n, sa, sb in BATCHED]  # fmt: skip
    for name, a, b in cases:
        flop = 2 * a.shape[-2] * a.shape[-1] * b.shape[-2] * (a.shape[0] if a.dim() == 3 else 1)
        ref = torch.matmul(a.double(), b.double().transpose(-1, -2))
        torch.backends.cuda.matmul.allow_tf32 = False
        t_sgemm = do_bench(lambda a=a, b=b: torch.matmul(a, b.transpose(-1, -2)))
        sg = torch.matmul(a, b.transpose(-1, -2))
        rows.append((name, "cuBLAS fp32 (SGEMM)", t_sgemm, flop / t_sgemm / 1e9, 1.0, errors(sg, ref)))
        torch.backends.cuda.matmul.allow_tf32 = True
        t_tf = do_bench(lambda a=a, b=b: torch.matmul(a, b.transpose(-1, -2)))
        tf = torch.matmul(a, b.transpose(-1, -2))
        torch.backends.cuda.matmul.allow_tf32 = False
        rows.append((name, "cuBLAS TF32", t_tf, flop / t_tf / 1e9, t_sgemm / t_tf, errors(tf, ref)))
        print(f"{name}: SGEMM {t_sgemm:.3f} ms, TF32 {t_tf:.3f} ms", flush=True)
        for p, mod in mods:
            t0 = time.time()
            try:
                c = mod.run(a, b)
                torch.cuda.synchronize()
                t = do_bench(lambda m=mod, a=a, b=b: m.run(a, b))
            except Exception as e:  # a point that fails to compile is reported, not fatal
                print(f"  {p}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            label = " ".join(f"{k}={v}" for k, v in p.items())
            rows.append((name, label, t, flop / t / 1e9, t_sgemm / t, errors(c, ref)))
            print(f"  {label}: {t:.3f} ms ({t_sgemm / t:.2f}x SGEMM, {time.time() - t0:.1f}s)", flush=True)
    print(
        "\n| shape | implementation | ms | TFLOP/s | x SGEMM | max err / max abs C | within L1/072 tol | "
        "within L1/054 tol |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, label, t, tf, x, err in rows:
        print(f"| {name} | {label} | {t:.4f} | {tf:.1f} | {x:.2f} | {err} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
