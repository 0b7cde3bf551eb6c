"""Time the generated fused-region kernels (kernelarc.graph.fusion) of SOL-ExecBench problems on the GPU against
the reference and torch.compile of the reference, measured in the same process, with the guard's correctness check.

    python3 scripts/gpu_fused_bench.py ROOT PROBLEM [PROBLEM ...] [--workloads N] [--max-gb G] [--out FILE]
        [--family fused.rowblock|scatter_add.sorted|matmul_f32.split|group_norm.split|moe|dwconv.tiled|
         counting_sort.blocked] [--point NAME=JSON ...]

For each problem: the workloads at the smallest, median and largest input size (``--workloads``: how many of
those, up to 3; inputs over ``--max-gb`` skipped), and for each: the reference, torch.compile of the reference
(dynamic=False, what the suite's baseline runs), and the composed candidate of ``--family`` (the fused regions'
by default) at a few points (``POINTS``: for the fused family its start point, twice the tile with twice the
warps, the CUDA-graph replay). Each candidate's outputs are compared
with the reference's on the same inputs by the guard's own rule (kernelarc.guard.compare, the workload's
tolerance; max abs error printed). Times are medians of ``triton.testing.do_bench`` (L2 flushed between
calls), in ms. A JSON line per row goes to ``--out``. ``--point NAME=JSON`` (repeatable) adds a point of knobs over
the family's start, e.g. ``--point w16='{"NUM_WARPS": 16}'``; ``--only-points`` times those alone.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kernelarc.families import families_for  # noqa: E402
from kernelarc.guard.compare import compare_output  # noqa: E402
from kernelarc.tasks.inputs import load_module, make_inputs  # noqa: E402
from kernelarc.tasks.loader import load_task  # noqa: E402

# points per composed family (by name suffix); a point with a knob the problem's family lacks is left out
POINTS = {
    "fused.rowblock": {
        "start": {},
        "tile8k_w8": {"TILE": 8192, "NUM_WARPS": 8},
        "tile2k_w4": {"TILE": 2048, "NUM_WARPS": 4},
        "graph": {"cuda_graph": True},
    },
    "scatter_add.sorted": {
        "start": {},
        "h2k_w8": {"BLOCK_H": 2048, "num_warps": 8},
        "h512_w4": {"BLOCK_H": 512, "num_warps": 4},
        "eager": {"rest": "eager"},
    },
    "matmul_f32.split": {
        "start": {},
        "tf32x3": {"PRECISION": "tf32x3"},
        "bf16x3_k64": {"PRECISION": "bf16x3", "BLOCK_K": 64},
        "eager": {"rest": "eager"},
    },
    # GroupNorm (+ SiLU, + residual) sites (kernelarc.families.groupnorm)
    "group_norm.split": {
        "start": {},
        "graph": {"cuda_graph": True},
        "b8k_w8": {"BLOCK": 8192, "num_warps": 8},
        "eager": {"rest": "eager"},
    },
    # expert loops (kernelarc.graph.moe): torch._grouped_mm, the Triton grouped GEMM at its start and other tiles,
    # one mm per routed expert
    "moe": {
        "grouped": {"gemm": "grouped"},
        "triton": {"gemm": "triton"},
        "tri_m32": {"gemm": "triton", "BLOCK_M": 32},
        "tri_n256": {"gemm": "triton", "BLOCK_N": 256, "num_warps": 8},
        "tri_m128": {"gemm": "triton", "BLOCK_M": 128, "num_warps": 8},
        "loop": {"gemm": "loop"},
    },
    # depthwise conv1d sites with their slices and pointwise ops (kernelarc.graph.dwconv)
    "dwconv.tiled": {
        "start": {},
        "r8_l1k_w8": {"BLOCK_R": 8, "BLOCK_L": 1024, "NUM_WARPS": 8},
        "r2_l2k_w4": {"BLOCK_R": 2, "BLOCK_L": 2048, "NUM_WARPS": 4},
        "r16_l256": {"BLOCK_R": 16, "BLOCK_L": 256, "NUM_WARPS": 4},
        "graph": {"cuda_graph": True},
    },
    # stable sorts of bounded keys with their histogram (kernelarc.graph.sorting)
    "counting_sort.blocked": {
        "start": {},
        "eager": {"rest": "eager"},
        "b256_w4": {"rest": "eager", "BLOCK": 256},
        "b2k_w8": {"rest": "eager", "BLOCK": 2048, "num_warps": 8},
        "graph": {"rest": "eager", "cuda_graph": True},
        "graph_ind": {"cuda_graph": True},
    },
}


def _outs(x):
    return list(x) if isinstance(x, tuple | list) else [x]


def _err(task, i: int, got, want) -> tuple[bool, float]:
    """Whether ``got`` passes the guard's own comparison (kernelarc.guard.compare, the workload's tolerance rule per
    output) against ``want``, and the largest absolute error."""
    ok, worst = True, 0.0
    for (name, _), g, w in zip(task.definition.outputs.items(), _outs(got), _outs(want), strict=True):
        tol = task.tolerance_rule(i, name)
        c = compare_output(name, g, w, None, tol.atol, tol.rtol, tol.ratio, max_error_cap=tol.max_error_cap,
                           allow_negative_inf=tol.allow_negative_inf, check_layout=False)  # fmt: skip
        ok &= c.ok
        worst = max(worst, c.max_abs_err if c.max_abs_err is not None else (0.0 if c.ok else math.inf))
    return ok, worst


def bench(fn, args) -> float:
    import triton.testing

    if not args or not any(isinstance(x, torch.Tensor) and x.is_cuda for x in args):  # a CPU dry run
        t = time.perf_counter()
        fn(*args)
        return (time.perf_counter() - t) * 1e3
    return float(triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=60, return_mode="median"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("problems", nargs="+")
    ap.add_argument("--workloads", type=int, default=2)
    ap.add_argument("--max-gb", type=float, default=6.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--family", default="fused.rowblock", choices=sorted(POINTS))
    ap.add_argument("--point", action="append", default=[], help="NAME=JSON knobs over the start (repeatable)")
    ap.add_argument("--only-points", action="store_true", help="the --point points only")
    a = ap.parse_args()
    points = {} if a.only_points else dict(POINTS[a.family])
    for spec in a.point:
        name, _, knobs = spec.partition("=")
        try:
            points[name] = json.loads(knobs)
        except json.JSONDecodeError as e:
            ap.error(f"--point {spec!r}: {e}")
    out = open(a.out, "a") if a.out else None  # noqa: SIM115 - appended row by row
    dev = torch.device(a.device)
    table = []
    for p in a.problems:
        t0 = time.time()
        try:
            task = load_task(Path(a.root) / p)
            fams = [f for f in families_for(task) if f.name.endswith(f".{a.family}")]
            if not fams:
                print(f"{p}: no {a.family} family", flush=True)
                continue
            fam = fams[0]
            sizes = sorted(range(len(task.workloads)), key=task.io_bytes)
            pick = list(dict.fromkeys([sizes[0], sizes[len(sizes) // 2], sizes[-1]]))[-max(1, a.workloads) :]
            ref = load_module(task.definition.reference, f"ref_{task.name}")
            comp = torch.compile(ref.run, dynamic=False)
            mods = {}
            for name, extra in points.items():
                try:
                    knobs = fam.check_point({**fam.start, **extra})
                except ValueError as e:  # a knob this problem's family lacks (no cuda_graph over host reads)
                    print(f"{p}: point {name} left out: {e}", flush=True)
                    continue
                mods[name] = load_module(fam.render(knobs), f"fz_{name}_{task.name}")
            for i in pick:
                gb = task.io_bytes(i) / 1e9
                if gb > a.max_gb:
                    print(f"{p} wl{i}: {gb:.1f} GB of inputs, skipped", flush=True)
                    continue
                args = make_inputs(task, i, 1234, dev)
                with torch.no_grad():
                    want = ref.run(*args)
                    row = {"problem": p, "workload": i, "gb": round(gb, 3), "ref_ms": bench(ref.run, args)}
                    got = comp(*args)
                    row["compile_ok"], _ = _err(task, i, got, want)
                    row["compile_ms"] = bench(comp, args)
                    for name, mod in mods.items():
                        got = mod.run(*args)
                        ok, worst = _err(task, i, got, want)
                        row[f"{name}_ok"], row[f"{name}_err"] = ok, worst
                        row[f"{name}_ms"] = bench(mod.run, args)
                del args, want, got
                torch.cuda.empty_cache()
                ok_ms = [(row[f"{n}_ms"], n) for n in mods if row[f"{n}_ok"]]
                row["best"] = min(ok_ms)[1] if ok_ms else None
                row["x_compile"] = row["compile_ms"] / min(ok_ms)[0] if ok_ms else None
                table.append(row)
                if out:
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                print(json.dumps(row), flush=True)
        except Exception:  # noqa: BLE001 - one problem's failure is printed, the rest still run
            traceback.print_exc()
            print(f"{p}: failed after {time.time() - t0:.0f}s", flush=True)
        print(f"{p}: {time.time() - t0:.0f}s", flush=True)
    print(f"\n{'problem':48} {'wl':>3} {'GB':>6} {'ref':>8} {'compile':>8} {'family':>10} {'point':>10} {'x tc':>6} ok")
    for r in table:
        bm = r[f"{r['best']}_ms"] if r["best"] else math.nan
        oks = "".join(("y" if r[f"{n}_ok"] else "n") for n in points if f"{n}_ok" in r)
        print(f"{r['problem'][:48]:48} {r['workload']:>3} {r['gb']:>6.3f} {r['ref_ms']:>8.4f} {r['compile_ms']:>8.4f} "
              f"{bm:>10.4f} {r['best'] or '-':>10} {r['x_compile'] or math.nan:>6.2f} {oks}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
