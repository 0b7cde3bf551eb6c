"""Registers and spills of the generated fused-region kernels (kernelarc.graph.fusion) at sm_90a, without a GPU.

    python3 scripts/fused_registers.py ROOT PROBLEM [PROBLEM ...] [--point TILE,WARPS ...]

For each fused region of each problem's first graph case, the region's kernel is rendered at each point (TILE
elements per row block, WARPS warps; 0 warps: the family's 'auto' rule), compiled for sm_90a by Triton (the
signature as Triton's launcher specialises it: unit column strides and unit row strides of per-row inputs as
constants, pointers and 16-divisible sizes marked divisible by 16) and its PTX assembled by the ``ptxas`` bundled
with Triton (``-v``). Prints the registers per thread and the bytes spilled. Register counts bound occupancy: a
kernel of R registers at W warps fits 65536 / (R * 32 * W) programs per SM.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelarc.families.base import ptxas_usage  # noqa: E402
from kernelarc.families.composed import recognise  # noqa: E402
from kernelarc.graph.capture import node_dtype  # noqa: E402
from kernelarc.graph.fusion import Role, auto_warps, render_fused  # noqa: E402
from kernelarc.graph.patterns import Kind  # noqa: E402
from kernelarc.tasks.loader import load_task  # noqa: E402

POINTER = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.bool: "*i1"}


def signature(kernel, region, const: dict) -> tuple[dict, dict]:
    sig, attrs = {}, {}
    div16 = region.H % 16 == 0
    for i, name in enumerate(kernel.arg_names):
        kind, idx = re.fullmatch(r"([a-zA-Z_]+?)(\d*)", name).groups()
        if name in const:
            sig[name] = "constexpr"
        elif kind in ("p", "o", "q"):
            dt = (
                torch.float32
                if kind == "q"
                else node_dtype(region.inputs[int(idx)] if kind == "p" else region.nodes[int(idx)])
            )
            sig[name], attrs[(i,)] = POINTER[dt], [["tt.divisibility", 16]]
        elif kind == "sc" or (kind == "sr" and region.roles[region.inputs[int(idx)]] is Role.row):
            sig[name], const[name] = "constexpr", 1
        else:  # a full input's row stride, R, H
            sig[name] = "i32"
            if div16 and name != "R":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def compile_region(region, tile: int, warps: int, work: Path) -> tuple[int, str, str]:
    block_h = triton.next_power_of_2(region.H)
    tile_r = max(1, tile // block_h)
    warps = warps or auto_warps(tile_r * block_h)
    src = render_fused(region, {"TILE": tile, "NUM_WARPS": warps, "WAVES": 8}, "register check")
    path = work / f"region_{abs(hash(src))}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    const = {"TILE_R": tile_r, "BLOCK_H": block_h}
    sig, attrs = signature(mod._fused_kernel, region, const)
    c = triton.compile(ASTSource(fn=mod._fused_kernel, signature=sig, constexprs=const, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})  # fmt: skip
    regs, spill = ptxas_usage(c.asm["ptx"])
    return warps, "?" if regs is None else str(regs), "?" if spill is None else str(spill)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("problems", nargs="+")
    ap.add_argument("--point", action="append", default=[], help="TILE,WARPS (0 warps: auto); repeatable")
    a = ap.parse_args()
    points = [tuple(int(v) for v in p.split(",")) for p in a.point] or [(4096, 0), (8192, 0)]
    os.environ.pop("TRITON_INTERPRET", None)
    with tempfile.TemporaryDirectory() as tmp:
        for p in a.problems:
            task = load_task(Path(a.root) / p, cpu=True)
            rec = recognise(task)
            sites = [s for s in (rec.sites[0] if rec.sites else []) if s.kind is Kind.fused]
            for i, s in enumerate(sites):
                r = s.params["_region"]
                if r.H is None:
                    continue
                cells = []
                for tile, warps in points:
                    w, regs, spill = compile_region(r, tile, warps, Path(tmp))
                    cells.append(f"{tile}/{w}w: {regs} regs, {spill} B spilled")
                print(f"{p[:48]:48} region {i} H={r.H} ops={len(r.nodes)} | " + " | ".join(cells), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
