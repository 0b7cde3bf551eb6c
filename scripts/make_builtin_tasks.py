"""Write the built-in task folders (kernelarc/tasks/builtin/*) in the SOL-ExecBench format.

The folders are committed; this script is how they were made and how to change them.
Run: python scripts/make_builtin_tasks.py
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "kernelarc" / "tasks" / "builtin"


def t(shape, dtype="bfloat16", desc=None):
    d = {"shape": shape, "dtype": dtype}
    if desc:
        d["description"] = desc
    return d


def var(desc):
    return {"type": "var", "description": desc}


ATTN_REF = """import math
import torch


@torch.no_grad()
def run(q, k, v{extra}causal):
    B, H, S, D = q.shape
    Hkv = k.shape[1]
    group = H // Hkv
    k = k.repeat_interleave(group, dim=1).to(torch.float32)
    v = v.repeat_interleave(group, dim=1).to(torch.float32)
    scores = torch.matmul(q.to(torch.float32), k.transpose(-1, -2)) * (1.0 / math.sqrt(D))
    if causal:
        mask = torch.ones(S, S, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~mask, float("-inf"))
    p = torch.softmax(scores, dim=-1)
    o = torch.matmul(p, v)
{ret}"""

FP8_REF = """import torch

SCALE_BLOCK = 128  # BlockWise1x128 activations, BlockWise128x128 weights (SOL-ExecBench Quant, torch._scaled_mm)
E4M3_MAX = 448.0


def _expand(scale, rows, cols, block_rows, block_cols):
    # one scale per block -> one per element (partial blocks at the edges cut off)
    return scale.repeat_interleave(block_rows, dim=0)[:rows].repeat_interleave(block_cols, dim=1)[:, :cols]


def _quantize(x, block_rows):
    # the Quant problems' recipe: scale = amax(block) / 448, q = clamp(x / scale) in e4m3
    rows, cols = x.shape
    rp = -(-rows // block_rows) * block_rows
    cp = -(-cols // SCALE_BLOCK) * SCALE_BLOCK
    xp = torch.zeros(rp, cp, dtype=x.dtype, device=x.device)
    xp[:rows, :cols] = x
    amax = xp.reshape(rp // block_rows, block_rows, cp // SCALE_BLOCK, SCALE_BLOCK).abs().amax(dim=(1, 3))
    scale = (amax / E4M3_MAX).clamp(min=1e-12)
    q = (x / _expand(scale, rows, cols, block_rows, SCALE_BLOCK)).clamp(-E4M3_MAX, E4M3_MAX)
    return q.to(torch.float8_e4m3fn), scale.to(torch.float32)


def get_inputs(axes, device):
    M, N, K = axes["M"], axes["N"], axes["K"]
    # magnitudes that differ by row and by weight block, so a scale read from the wrong block shows
    x = torch.randn(M, K, device=device) * torch.exp(torch.randn(M, 1, device=device))
    nb, kb = -(-N // SCALE_BLOCK), -(-K // SCALE_BLOCK)
    w = torch.randn(N, K, device=device) * _expand(torch.exp(torch.randn(nb, kb, device=device)), N, K,
                                                    SCALE_BLOCK, SCALE_BLOCK)
    A, scale_a = _quantize(x, 1)
    B, scale_b = _quantize(w, SCALE_BLOCK)
    return {"A": A, "B": B, "scale_a": scale_a, "scale_b": scale_b}


@torch.no_grad()
def run(A, B, scale_a, scale_b):
    # dequantise, then one matmul (float64 when the judge upcasts the inputs for its high-precision check)
    dt = torch.float64 if A.dtype == torch.float64 else torch.float32
    M, K = A.shape
    N = B.shape[0]
    a = A.to(dt) * _expand(scale_a.to(dt), M, K, 1, SCALE_BLOCK)
    b = B.to(dt) * _expand(scale_b.to(dt), N, K, SCALE_BLOCK, SCALE_BLOCK)
    return (a @ b.T).to(torch.float64 if dt == torch.float64 else torch.bfloat16)
"""

TASKS = {
    "matmul": dict(
        description="C = A @ B.T in bf16 with fp32 accumulation (B in nn.Linear weight layout).",
        axes={"M": var("rows of A"), "N": var("rows of B (output features)"), "K": var("reduction")},
        inputs={"A": t(["M", "K"]), "B": t(["N", "K"])},
        outputs={"C": t(["M", "N"])},
        reference="import torch\n\n\n@torch.no_grad()\ndef run(A, B):\n    return torch.matmul(A, B.T)\n",
        gpu=[
            dict(M=4096, N=4096, K=4096),
            dict(M=8192, N=8192, K=8192),
            dict(M=16384, N=8192, K=1024),
            dict(M=4096, N=14336, K=4096),
            dict(M=16, N=8192, K=8192),
        ],
        cpu=[dict(M=64, N=32, K=48), dict(M=37, N=50, K=70)],
    ),
    "fp8_matmul": dict(
        description="fp8 e4m3 GEMM C = (A * scale_a) @ (B * scale_b).T in bf16 with blockwise scales as "
        "SOL-ExecBench's Quant problems: 1x128 for A (activations), 128x128 for B (weights, nn.Linear layout).",
        axes={
            "M": var("rows of A (tokens)"),
            "N": var("rows of B (output features)"),
            "K": var("reduction"),
            "KB": {"type": "expr", "expression": "(K + 127) // 128"},
            "NB": {"type": "expr", "expression": "(N + 127) // 128"},
        },
        inputs={
            "A": t(["M", "K"], "float8_e4m3fn"),
            "B": t(["N", "K"], "float8_e4m3fn"),
            "scale_a": t(["M", "KB"], "float32", "dequantisation scale per row and 128-wide K block"),
            "scale_b": t(["NB", "KB"], "float32", "dequantisation scale per 128x128 block of B"),
        },
        outputs={"C": t(["M", "N"])},
        reference=FP8_REF,
        custom_inputs_entrypoint="get_inputs",
        gpu=[
            dict(M=8192, N=8192, K=8192),
            dict(M=4096, N=4096, K=4096),
            dict(M=8192, N=7168, K=16384),  # 015_fp8_mla_attention_output_projection's widest projection
            dict(M=3584, N=18944, K=3584),  # 003_fp8_mlp_gate_up_projection
        ],
        cpu=[dict(M=48, N=160, K=256), dict(M=37, N=130, K=200)],
    ),
    "attention": dict(
        description="Scaled dot-product attention forward, bf16, optional causal mask, GQA.",
        axes={
            "B": var("batch"),
            "H": var("query heads"),
            "Hkv": var("key/value heads"),
            "S": var("sequence length"),
            "D": var("head dim"),
        },
        constraints=["H % Hkv == 0"],
        inputs={
            "q": t(["B", "H", "S", "D"]),
            "k": t(["B", "Hkv", "S", "D"]),
            "v": t(["B", "Hkv", "S", "D"]),
            "causal": t(None, "int32", "1: query i attends to keys j <= i"),
        },
        outputs={"o": t(["B", "H", "S", "D"])},
        reference=ATTN_REF.format(extra=", ", ret="    return o.to(q.dtype)\n"),
        gpu=[
            dict(B=4, H=32, Hkv=32, S=4096, D=128, causal=0),
            dict(B=4, H=32, Hkv=32, S=4096, D=128, causal=1),
            dict(B=4, H=32, Hkv=8, S=4096, D=128, causal=1),
            dict(B=8, H=16, Hkv=16, S=2048, D=64, causal=0),
        ],
        cpu=[dict(B=1, H=2, Hkv=1, S=32, D=16, causal=0), dict(B=1, H=2, Hkv=2, S=40, D=16, causal=1)],
    ),
    "attention_residual": dict(
        description="Attention forward followed by a residual add: o = attention(q, k, v) + residual.",
        axes={
            "B": var("batch"),
            "H": var("query heads"),
            "Hkv": var("key/value heads"),
            "S": var("sequence length"),
            "D": var("head dim"),
        },
        constraints=["H % Hkv == 0"],
        inputs={
            "q": t(["B", "H", "S", "D"]),
            "k": t(["B", "Hkv", "S", "D"]),
            "v": t(["B", "Hkv", "S", "D"]),
            "residual": t(["B", "H", "S", "D"]),
            "causal": t(None, "int32", "1: causal mask"),
        },
        outputs={"o": t(["B", "H", "S", "D"])},
        reference=ATTN_REF.format(
            extra=", residual, ", ret="    return (o + residual.to(torch.float32)).to(q.dtype)\n"
        ),
        gpu=[dict(B=4, H=32, Hkv=32, S=4096, D=128, causal=0), dict(B=4, H=32, Hkv=32, S=4096, D=128, causal=1)],
        cpu=[dict(B=1, H=2, Hkv=1, S=32, D=16, causal=1), dict(B=1, H=2, Hkv=2, S=24, D=16, causal=0)],
    ),
    "rmsnorm": dict(
        description="RMSNorm over the last dim, eps 1e-6, fp32 math.",
        axes={"M": var("tokens"), "N": var("hidden size")},
        inputs={"x": t(["M", "N"]), "weight": t(["N"])},
        outputs={"y": t(["M", "N"])},
        reference=(
            "import torch\n\n\n@torch.no_grad()\ndef run(x, weight):\n    xf = x.to(torch.float32)\n"
            "    inv = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + 1e-6)\n"
            "    return (xf * inv * weight.to(torch.float32)).to(x.dtype)\n"
        ),
        gpu=[dict(M=32768, N=4096), dict(M=16384, N=8192), dict(M=4096, N=2048)],
        cpu=[dict(M=8, N=64), dict(M=5, N=100)],
    ),
    "fused_add_rmsnorm": dict(
        description="r = x + residual; returns (rmsnorm(r) * weight, r), eps 1e-6, fp32 math.",
        axes={"M": var("tokens"), "N": var("hidden size")},
        inputs={"x": t(["M", "N"]), "residual": t(["M", "N"]), "weight": t(["N"])},
        outputs={"out": t(["M", "N"]), "residual_out": t(["M", "N"])},
        reference=(
            "import torch\n\n\n@torch.no_grad()\ndef run(x, residual, weight):\n"
            "    r = x.to(torch.float32) + residual.to(torch.float32)\n"
            "    inv = torch.rsqrt(r.pow(2).mean(dim=-1, keepdim=True) + 1e-6)\n"
            "    return (r * inv * weight.to(torch.float32)).to(x.dtype), r.to(x.dtype)\n"
        ),
        gpu=[dict(M=32768, N=4096), dict(M=16384, N=8192), dict(M=4096, N=2048)],
        cpu=[dict(M=8, N=64), dict(M=5, N=100)],
    ),
    "softmax": dict(
        description="Row softmax over the last dim, fp32 math, bf16 in and out.",
        axes={"M": var("rows"), "N": var("row length")},
        inputs={"x": t(["M", "N"])},
        outputs={"y": t(["M", "N"])},
        reference=(
            "import torch\n\n\n@torch.no_grad()\ndef run(x):\n"
            "    return torch.softmax(x.to(torch.float32), dim=-1).to(x.dtype)\n"
        ),
        gpu=[dict(M=8192, N=4096), dict(M=4096, N=32768), dict(M=65536, N=1024)],
        cpu=[dict(M=6, N=50), dict(M=4, N=300)],
    ),
    "swiglu": dict(
        description="SwiGLU activation: x = [gate | up] along the last dim; silu(gate) * up.",
        axes={"M": var("tokens"), "N": var("intermediate size"), "N2": {"type": "expr", "expression": "N * 2"}},
        inputs={"x": t(["M", "N2"])},
        outputs={"y": t(["M", "N"])},
        reference=(
            "import torch\n\n\n@torch.no_grad()\ndef run(x):\n    n = x.shape[-1] // 2\n"
            "    gate = x[..., :n].to(torch.float32)\n    up = x[..., n:].to(torch.float32)\n"
            "    return (gate * torch.sigmoid(gate) * up).to(x.dtype)\n"
        ),
        gpu=[dict(M=8192, N=14336), dict(M=16384, N=4096)],
        cpu=[dict(M=5, N=24), dict(M=3, N=70)],
    ),
    "rope": dict(
        description="NeoX (rotate-half) rotary embedding applied to q and k.",
        axes={
            "T": var("tokens"),
            "H": var("query heads"),
            "Hkv": var("key heads"),
            "D": var("head dim"),
            "D2": {"type": "expr", "expression": "D // 2"},
        },
        constraints=["D % 2 == 0"],
        inputs={
            "q": t(["T", "H", "D"]),
            "k": t(["T", "Hkv", "D"]),
            "cos": t(["T", "D2"], "float32"),
            "sin": t(["T", "D2"], "float32"),
        },
        outputs={"q_out": t(["T", "H", "D"]), "k_out": t(["T", "Hkv", "D"])},
        reference=(
            "import torch\n\n\ndef _rot(x, cos, sin):\n    h = x.shape[-1] // 2\n"
            "    x1 = x[..., :h].to(torch.float32)\n    x2 = x[..., h:].to(torch.float32)\n"
            "    c = cos[:, None, :]\n    s = sin[:, None, :]\n"
            "    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)\n\n\n"
            "@torch.no_grad()\ndef run(q, k, cos, sin):\n    return _rot(q, cos, sin), _rot(k, cos, sin)\n"
        ),
        gpu=[dict(T=16384, H=32, Hkv=8, D=128), dict(T=65536, H=8, Hkv=2, D=64)],
        cpu=[dict(T=7, H=2, Hkv=1, D=16), dict(T=5, H=3, Hkv=3, D=8)],
    ),
}


def workload(name: str, spec: dict, values: dict) -> dict:
    axes = {k: v for k, v in values.items() if k in spec["axes"] and spec["axes"][k]["type"] == "var"}
    inputs = {}
    for iname, ispec in spec["inputs"].items():
        if spec.get("custom_inputs_entrypoint"):
            inputs[iname] = {"type": "custom"}
        elif ispec["shape"] is None:
            inputs[iname] = {"type": "scalar", "value": values[iname]}
        else:
            inputs[iname] = {"type": "random"}
    key = f"kernelarc/{name}/" + ",".join(f"{k}={v}" for k, v in sorted(values.items()))
    return {"uuid": str(uuid.uuid5(uuid.NAMESPACE_URL, key)), "axes": axes, "inputs": inputs}


def main() -> None:
    for name, spec in TASKS.items():
        d = OUT / name
        d.mkdir(parents=True, exist_ok=True)
        definition = {
            "name": name,
            "description": spec["description"],
            "axes": spec["axes"],
            "custom_inputs_entrypoint": spec.get("custom_inputs_entrypoint"),
            "inputs": spec["inputs"],
            "outputs": spec["outputs"],
            "reference": spec["reference"],
        }
        if spec.get("constraints"):
            definition["constraints"] = spec["constraints"]
        (d / "definition.json").write_text(json.dumps(definition, indent=2) + "\n")
        for fname, key in (("workload.jsonl", "gpu"), ("workload_cpu.jsonl", "cpu")):
            lines = [json.dumps(workload(name, spec, v)) for v in spec[key]]
            (d / fname).write_text("\n".join(lines) + "\n")
    print(f"wrote {len(TASKS)} tasks under {OUT}")


if __name__ == "__main__":
    main()
