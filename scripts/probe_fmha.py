"""Sweep the CUTLASS Hopper attention family's knob classes on the GPU, each point in its own
process under a hard time limit, to find the points that hang or fail and to time the rest
against cuDNN SDPA side by side.

    python scripts/probe_fmha.py --out $OUT [--stages 4] [--timeout 60] [--jobs 12]

Phase 1 builds every point in parallel (nvcc, one process per point). Phase 2 runs the points
one at a time: dense and causal attention (B4 H32 S4096 D128, bf16), checked against an fp32
SDPA on the first batch and head group, then timed with CUDA events, interleaved with cuDNN
SDPA in the same process (--rounds rounds, alternating which goes first; the table gives the best
of each side and the ratio of medians). With --points whose knobs carry RESIDUAL, the
attention_residual family is probed instead, against cuDNN SDPA followed by the add. A point that
has not answered within --timeout is killed and listed as a hang. Prints one table last; writes
probe_fmha.jsonl under --out.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kernelarc.families.cutlass_fmha import CUTLASS_FMHA  # noqa: E402

RUN_POINT = r"""
import json, sys, torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from kernelarc.families.cutlass_fmha import CUTLASS_FMHA, CUTLASS_FMHA_RESIDUAL
from kernelarc.tasks.inputs import load_module
knobs = json.loads(sys.argv[1])
residual = "RESIDUAL" in knobs
mod = load_module((CUTLASS_FMHA_RESIDUAL if residual else CUTLASS_FMHA).render(knobs), "probe")
if sys.argv[2] == "build":
    print(json.dumps({"built": True})); sys.exit(0)
torch.manual_seed(0)
B, H, S, D = 4, 32, 4096, 128
q, k, v, r = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
args = (lambda c: (q, k, v, r, c)) if residual else (lambda c: (q, k, v, c))
def events(fn, n=20):
    fn(); torch.cuda.synchronize()
    ts = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); torch.cuda.synchronize(); ts.append(a.elapsed_time(b))
    return sorted(ts)[len(ts) // 2]
res = {}
for causal in (False, True):
    o = mod.run(*args(causal))
    torch.cuda.synchronize()
    ref = F.scaled_dot_product_attention(q[:1, :8].float(), k[:1, :8].float(), v[:1, :8].float(), is_causal=causal)
    if residual:
        ref = ref + r[:1, :8].float()
    err = (o[:1, :8].float() - ref).abs().max().item()
    def cudnn():  # the library route: cuDNN SDPA, then the add
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return out + r if residual else out
    mine, lib = [], []
    sides = [(mine, lambda: mod.run(*args(causal))), (lib, cudnn)]
    for i in range(int(sys.argv[3])):  # interleaved rounds, alternating which goes first
        for times, fn in sides[:: -1 if i % 2 else 1]:
            times.append(events(fn))
    name = "causal" if causal else "dense"
    res[name] = {"max_abs_err": err, "ms": min(mine), "cudnn_ms": min(lib), "vs_cudnn": min(lib) / min(mine),
                 "spread": [max(mine) / min(mine) - 1, max(lib) / min(lib) - 1],
                 "vs_cudnn_median": sorted(lib)[len(lib) // 2] / sorted(mine)[len(mine) // 2]}
print(json.dumps(res))
"""


def points(stages: list[int]) -> list[dict]:
    out = []
    for kv, sched, pers, order, st in itertools.product((64, 128), ("cooperative", "pingpong"), (False, True),
                                                        (False, True), stages):  # fmt: skip
        if sched == "pingpong" and not pers:
            continue  # the family renders ping-pong persistent either way
        k = {"BLOCK_Q": 128, "BLOCK_KV": kv, "SCHEDULE": sched, "PERSISTENT": pers, "STAGES_KV": st,
             "ORDER_SOFTMAX": order}  # fmt: skip
        if CUTLASS_FMHA.valid(k):
            out.append(k)
    return out


def call(knobs: dict, mode: str, timeout: float, rounds: int = 3) -> dict:
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", RUN_POINT, json.dumps(knobs), mode, str(rounds)], capture_output=True,
                           text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"error": f"no answer within {timeout:.0f} s ({mode}): hang", "s": time.monotonic() - t0}
    if p.returncode != 0:
        return {"error": (p.stderr or p.stdout).strip().splitlines()[-1:], "s": time.monotonic() - t0}
    return {**json.loads(p.stdout.strip().splitlines()[-1]), "s": round(time.monotonic() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="probe_out")
    ap.add_argument("--stages", default="4", help="comma-separated STAGES_KV values")
    ap.add_argument("--timeout", type=float, default=60.0, help="per point, run phase")
    ap.add_argument("--build-timeout", type=float, default=400.0)
    ap.add_argument(
        "--points",
        help="JSON list of knob dicts instead of the sweep (a RESIDUAL knob: the "
        "attention_residual family, against cuDNN SDPA followed by the add)",
    )
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds against cuDNN per point")
    ap.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pts = json.loads(args.points) if args.points else points([int(s) for s in args.stages.split(",")])
    print(f"{len(pts)} points; building with {args.jobs} jobs", flush=True)
    with ThreadPoolExecutor(args.jobs) as ex:
        builds = list(ex.map(lambda k: call(k, "build", args.build_timeout), pts))
    rows = []
    with (out / "probe_fmha.jsonl").open("w") as fh:
        for k, b in zip(pts, builds, strict=True):
            r = call(k, "run", args.timeout, args.rounds) if "error" not in b else {"error": b["error"]}
            r["build_s"] = b.get("s")
            row = {"knobs": k, **r}
            rows.append(row)
            fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    print("\n| BLOCK_KV | schedule | persistent | ordered softmax | stages | residual | dense ms | vs cuDNN, best "
          "(median) | causal ms | vs cuDNN, best (median) | spread mine / cuDNN | max err | note |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")

    def ratio(x: dict) -> str:
        return f"{x['vs_cudnn']:.3f}x ({x['vs_cudnn_median']:.3f}x)" if x else "-"

    def spread(x: dict) -> str:
        return "/".join(f"{100 * v:.1f}%" for v in x["spread"]) if x else "-"

    for r in rows:
        k = r["knobs"]
        d, c = r.get("dense", {}), r.get("causal", {})
        err = max(d.get("max_abs_err", 0), c.get("max_abs_err", 0)) if d else None
        cells = [k["BLOCK_KV"], k["SCHEDULE"], k["PERSISTENT"], k["ORDER_SOFTMAX"], k["STAGES_KV"],
                 k.get("RESIDUAL", "-"), f"{d['ms']:.3f}" if d else "-", ratio(d),
                 f"{c['ms']:.3f}" if c else "-", ratio(c),
                 f"{spread(d)}, {spread(c)}", f"{err:.3g}" if err is not None else "-",
                 str(r.get("error", ""))[:80]]  # fmt: skip
        print("| " + " | ".join(map(str, cells)) + " |")


if __name__ == "__main__":
    main()
