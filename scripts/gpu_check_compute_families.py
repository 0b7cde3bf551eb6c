#!/usr/bin/env python3
"""One-shot H200 check of the compute-bound kernel families (matmul, attention, attention_residual).

For each family it renders the conservative start point and a handful of strong points,
checks them against an fp32 torch reference on upcast inputs (relative error norm < 1e-2)
on the tasks' GPU shapes, and times them with triton.testing.do_bench (median) next to
torch: cuBLAS (A @ B.T) for matmul; SDPA with the cuDNN and FLASH_ATTENTION backends for
attention (enable_gqa for GQA), plus the residual add for attention_residual.

Layout: the orchestrator (default mode) runs every step as a child process under the
`timeout` command: a parallel pre-compile pass (warms Triton's cache on many CPU cores),
then one process per task group. Groups append one JSON line per measurement, so a hung
or crashed candidate loses only itself: the orchestrator restarts the group skipping it.
Results land in $OUT (or ./gpu_check_out): results.jsonl, table.txt.

Usage on the GPU machine:  PYTHONUNBUFFERED=1 python scripts/gpu_check_compute_families.py
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OUT = Path(os.environ.get("OUT") or (ROOT / "gpu_check_out"))
CAND_DIR = Path("/tmp/kernelarc_gpu_check_cands")
RESULTS = OUT / "results.jsonl"
TOTAL_BUDGET_S = float(os.environ.get("GPU_CHECK_BUDGET_S", "280"))
REL_TOL = 1e-2
# GPU_CHECK_DRY=1: rehearse the whole flow on the CPU (interpreter, tiny shapes)
DRY = os.environ.get("GPU_CHECK_DRY") == "1"
DEVICE = "cpu" if DRY else "cuda"
if DRY:
    os.environ["TRITON_INTERPRET"] = "1"

# ------------------------------------------------------------------------------------------
# what to run
# ------------------------------------------------------------------------------------------

MM_SHAPES = {
    "4096^3": (4096, 4096, 4096),
    "8192^3": (8192, 8192, 8192),
    "16384x8192x1024": (16384, 8192, 1024),
    "4096x14336x4096": (4096, 14336, 4096),
    "skinny16x8192x8192": (16, 8192, 8192),
}
SKINNY = ["skinny16x8192x8192"]

# (B, H, Hkv, S, D, causal)
ATTN_SHAPES = {
    "B4H32S4096D128": (4, 32, 32, 4096, 128, 0),
    "B4H32S4096D128c": (4, 32, 32, 4096, 128, 1),
    "B4H32kv8S4096D128c": (4, 32, 8, 4096, 128, 1),
    "B8H16S2048D64": (8, 16, 16, 2048, 64, 0),
}
if DRY:
    MM_SHAPES = {k: (min(M, 96), min(N, 80), min(K, 64)) for k, (M, N, K) in MM_SHAPES.items()}
    ATTN_SHAPES = {k: (1, 2, 1 if "kv8" in k else 2, 64, 16, c) for k, (_, _, _, _, _, c) in ATTN_SHAPES.items()}

_BIG = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8}

# (family, label, knobs, shapes or None for all of the task's shapes)
CANDIDATES = [
    ("matmul.tiled", "tiled:start", {}, None),
    ("matmul.tiled", "tiled:128x256x64w8s3", {**_BIG, "num_stages": 3}, None),
    ("matmul.tiled", "tiled:128x256x64w8s4tma", {**_BIG, "num_stages": 4, "MEMORY": "tma"}, None),
    (
        "matmul.tiled",
        "tiled:128x128x64w4s4tma",
        {**_BIG, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "MEMORY": "tma"},
        None,
    ),
    ("matmul.persistent_tma", "pers:start", {}, None),
    ("matmul.persistent_tma", "pers:128x256x64w8s3", {**_BIG, "num_stages": 3}, None),
    ("matmul.persistent_tma", "pers:128x256x64w8s4sub2", {**_BIG, "num_stages": 4, "EPILOGUE_SUBTILE": 2}, None),
    (
        "matmul.persistent_tma",
        "pers:128x256x64w8s3sub2flat",
        {**_BIG, "num_stages": 3, "EPILOGUE_SUBTILE": 2, "FLATTEN": True},
        None,
    ),
    ("matmul.persistent_tma", "pers:128x256x64w8s3dev", {**_BIG, "num_stages": 3, "DESCRIPTORS": "device"}, None),
    (
        "matmul.persistent_tma",
        "pers:128x256x64w4s3wsDev",
        {**_BIG, "num_warps": 4, "num_stages": 3, "WARP_SPECIALIZE": True, "DESCRIPTORS": "device"},
        None,
    ),
    (
        "matmul.persistent_tma",
        "pers:128x128x64w4s4wsDev",
        {**_BIG, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "WARP_SPECIALIZE": True, "DESCRIPTORS": "device"},
        None,
    ),
    (
        "matmul.persistent_tma",
        "pers:64x128x64w4s4ws",
        {**_BIG, "BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4, "WARP_SPECIALIZE": True},
        None,
    ),
    ("matmul.splitk", "splitk:start", {}, None),
    (
        "matmul.splitk",
        "splitk:swap64x16x128k4",
        {"SWAP_AB": True, "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 4, "num_stages": 4},
        SKINNY,
    ),
    (
        "matmul.splitk",
        "splitk:swap128x16x64k2",
        {"SWAP_AB": True, "BLOCK_M": 128, "BLOCK_N": 16, "BLOCK_K": 64, "SPLIT_K": 2, "num_stages": 5},
        SKINNY,
    ),
    (
        "matmul.splitk",
        "splitk:swap64x16x256k8at",
        {
            "SWAP_AB": True,
            "BLOCK_M": 64,
            "BLOCK_N": 16,
            "BLOCK_K": 256,
            "SPLIT_K": 8,
            "REDUCE": "atomic",
            "num_stages": 3,
        },
        SKINNY,
    ),
    (
        "matmul.splitk",
        "splitk:16x64x128k4at",
        {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "REDUCE": "atomic", "num_stages": 4},
        SKINNY,
    ),
    (
        "matmul.splitk",
        "splitk:swap64x16x128k1",
        {"SWAP_AB": True, "BLOCK_M": 64, "BLOCK_N": 16, "BLOCK_K": 128, "SPLIT_K": 1, "num_stages": 4},
        SKINNY,
    ),
    ("attention.flash", "fa:start", {}, None),
    ("attention.flash", "fa:128x64w8s3", {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}, None),
    (
        "attention.flash",
        "fa:128x64w8s3tma",
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "MEMORY": "tma"},
        None,
    ),
    (
        "attention.flash",
        "fa:128x128w8s2tma",
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "MEMORY": "tma"},
        None,
    ),
    (
        "attention.flash",
        "fa:128x128w8s3tma",
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "MEMORY": "tma"},
        None,
    ),
    (
        "attention.flash",
        "fa:128x64w8s4tmaQ",
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 4, "MEMORY": "tma", "SCALE": "q"},
        None,
    ),
    (
        "attention.flash",
        "fa:128x128w8s2tmaRev",
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "MEMORY": "tma", "M_ORDER": "reverse"},
        None,
    ),
    # (2026-11-30 run: the warp-specialized single-loop points, 128x64 and 128x128 at 4 warps,
    # hung on the H200; the knob was removed. The single loop itself stays a knob value.)
    (
        "attention.flash",
        "fa:128x128w8s3tmaSingle",
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "MEMORY": "tma", "LOOP": "single"},
        None,
    ),
    (
        "attention.flash",
        "fa:128x64w16s3tma",
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 16, "num_stages": 3, "MEMORY": "tma"},
        None,
    ),
    ("attention_residual.flash", "far:start", {}, None),
    (
        "attention_residual.flash",
        "far:128x64w8s3tma",
        {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3, "MEMORY": "tma"},
        None,
    ),
    (
        "attention_residual.flash",
        "far:128x128w8s2tma",
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2, "MEMORY": "tma"},
        None,
    ),
    (
        "attention_residual.flash",
        "far:128x128w8s3tma",
        {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3, "MEMORY": "tma"},
        None,
    ),
]

GROUPS = {"matmul": ("matmul",), "attention": ("attention", "attention_residual")}


def log(msg: str) -> None:
    print(msg, flush=True)


def cand_task(fam_name: str) -> str:
    return fam_name.split(".")[0]


def shapes_for(task: str, shapes):
    table = MM_SHAPES if task == "matmul" else ATTN_SHAPES
    return list(table) if shapes is None else list(shapes)


def get_family(fam_name: str):
    # only this script's own family modules: the package's discovery would import every
    # family module in the tree, including ones other people are editing right now
    from kernelarc.families import attention, matmul

    return {f.name: f for f in (*matmul.FAMILIES, *attention.FAMILIES)}[fam_name]


def module_path(fam_name: str, knobs: dict) -> Path:
    fam = get_family(fam_name)
    src = fam.render(fam.check_point(knobs))
    name = "cand_" + hashlib.sha1(src.encode()).hexdigest()[:16]
    CAND_DIR.mkdir(parents=True, exist_ok=True)
    path = CAND_DIR / f"{name}.py"
    if not path.exists():
        path.write_text(src)
    return path


def load_module(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------------------
# inputs, references, baselines
# ------------------------------------------------------------------------------------------


def make_inputs(task: str, shape_name: str, seed: int):
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    if task == "matmul":
        M, N, K = MM_SHAPES[shape_name]
        A = torch.randn(M, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
        B = torch.randn(N, K, device=DEVICE, dtype=torch.bfloat16, generator=g)
        return (A, B)
    B, H, HKV, S, D, causal = ATTN_SHAPES[shape_name]
    q = torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    k = torch.randn(B, HKV, S, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    v = torch.randn(B, HKV, S, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
    if task == "attention_residual":
        r = torch.randn(B, H, S, D, device=DEVICE, dtype=torch.bfloat16, generator=g)
        return (q, k, v, r, causal)
    return (q, k, v, causal)


def reference(task: str, inputs):
    import torch
    import torch.nn.functional as F

    torch.backends.cuda.matmul.allow_tf32 = False
    if task == "matmul":
        A, B = inputs
        return A.float() @ B.float().T
    q, k, v = inputs[:3]
    causal = inputs[-1]
    group = q.shape[1] // k.shape[1]
    out = torch.empty(q.shape, device=q.device, dtype=torch.float32)
    for b in range(q.shape[0]):  # one batch at a time keeps the fp32 temporaries small
        kb = k[b : b + 1].float().repeat_interleave(group, dim=1)
        vb = v[b : b + 1].float().repeat_interleave(group, dim=1)
        out[b : b + 1] = F.scaled_dot_product_attention(q[b : b + 1].float(), kb, vb, is_causal=bool(causal))
    if task == "attention_residual":
        out += inputs[3].float()
    return out


def baselines(task: str, inputs):
    """name -> zero-argument callable (torch's library kernels)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if task == "matmul":
        A, B = inputs
        return {"cuBLAS": lambda: A @ B.T}
    q, k, v = inputs[:3]
    causal = bool(inputs[-1])
    gqa = q.shape[1] != k.shape[1]
    res = inputs[3] if task == "attention_residual" else None
    out = {}
    for name, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("FA2(torch)", SDPBackend.FLASH_ATTENTION)):

        def fn(backend=backend):
            with sdpa_kernel(backend):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
            return o + res if res is not None else o

        out[name] = fn
    return out


def flops(task: str, shape_name: str) -> float:
    if task == "matmul":
        M, N, K = MM_SHAPES[shape_name]
        return 2.0 * M * N * K
    B, H, _, S, D, causal = ATTN_SHAPES[shape_name]
    f = 4.0 * B * H * S * S * D
    return f / 2 if causal else f


def rel_err(out, ref) -> float:
    import torch

    if not isinstance(out, torch.Tensor) or out.shape != ref.shape:
        return float("inf")
    d = out.float() - ref
    if not torch.isfinite(d).all():
        return float("nan")
    return (d.norm() / ref.norm()).item()


# ------------------------------------------------------------------------------------------
# modes
# ------------------------------------------------------------------------------------------


def _warm_one(job):
    """Pre-compile worker: run one candidate once on each of its shapes (fills the cache)."""
    fam_name, label, knobs, shapes = job

    t0 = time.time()
    errors = {}
    try:
        mod = load_module(module_path(fam_name, knobs))
    except Exception as e:  # noqa: BLE001
        return label, time.time() - t0, {"*": f"{type(e).__name__}: {e}"[:300]}
    task = cand_task(fam_name)
    if DRY and os.environ.get("GPU_CHECK_DRY_HANG") == label:
        time.sleep(1e6)  # rehearse a hung warm-up run
    for s in shapes_for(task, shapes):
        try:
            inputs = make_inputs(task, s, seed=1)
            mod.run(*inputs)
            sync()
        except Exception as e:  # noqa: BLE001
            errors[s] = f"{type(e).__name__}: {e}"[:300]
    return label, time.time() - t0, errors


def sync() -> None:
    import torch

    if not DRY:
        torch.cuda.synchronize()


def mode_precompile(workers: int, budget: float) -> None:
    import concurrent.futures as cf
    import multiprocessing as mp

    t0 = time.time()
    jobs = list(CANDIDATES)
    log(f"[precompile] {len(jobs)} candidates on {workers} workers")
    ctx = mp.get_context("spawn")
    pool = cf.ProcessPoolExecutor(max_workers=workers, mp_context=ctx)
    futs = {pool.submit(_warm_one, j): j[1] for j in jobs}
    pending = set(futs)
    last_done = time.time()
    while pending:
        done, pending = cf.wait(pending, timeout=1.0, return_when=cf.FIRST_COMPLETED)
        for fut in done:
            last_done = time.time()
            try:
                label, dt, errors = fut.result()
                log(f"[precompile] {label:32s} {dt:6.1f}s {'ERR ' + json.dumps(errors) if errors else 'ok'}")
            except Exception as e:  # noqa: BLE001
                log(f"[precompile] {futs[fut]} worker failed: {e}")
        stalled = time.time() - last_done > STALL_S
        if pending and (time.time() - t0 > budget or stalled):
            log(
                f"[precompile] {'stalled' if stalled else 'budget reached'}; left for the groups: "
                f"{sorted(futs[f] for f in pending)}"
            )
            # end the workers this pool started (a hung warm-up run would block shutdown)
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.terminate()
            break
    pool.shutdown(wait=False, cancel_futures=True)
    log(f"[precompile] done in {time.time() - t0:.1f}s")


_WATCH = {"deadline": None, "key": None}
STEP_LIMIT_S = 8 if DRY else 40
STALL_S = 10.0 if DRY else 40.0  # pre-compile: no job finished for this long -> a warm-up run hangs


def _watchdog() -> None:
    """Ends this process when one measurement runs too long (a hung kernel blocks the main
    thread inside CUDA, where no signal reaches it); the orchestrator then skips that key."""
    while True:
        time.sleep(0.5)
        d = _WATCH["deadline"]
        if d is not None and time.time() > d:
            log(f"[watchdog] {_WATCH['key']} exceeded its time; ending the group process")
            os._exit(3)


def mode_group(group: str, skip: set[str]) -> None:
    import threading

    import torch
    import triton

    threading.Thread(target=_watchdog, daemon=True).start()

    def bench(fn):
        if DRY:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return triton.testing.do_bench(fn, warmup=20, rep=60, return_mode="median")

    tasks = GROUPS[group]

    def emit(rec):
        with open(RESULTS, "a") as f:
            f.write(json.dumps(rec) + "\n")

    for task in tasks:
        table = MM_SHAPES if task == "matmul" else ATTN_SHAPES
        for shape in table:
            inputs = make_inputs(task, shape, seed=hash((task, shape)) % 1000 + 7)
            ref = reference(task, inputs)
            fl = flops(task, shape)
            for name, fn in baselines(task, inputs).items():
                key = f"{task}|{shape}|{name}"
                if key in skip:
                    continue
                emit({"key": key, "state": "start"})
                _WATCH.update(deadline=time.time() + STEP_LIMIT_S, key=key)
                try:
                    err = rel_err(fn(), ref)
                    ms = bench(fn)
                    rec = {
                        "key": key,
                        "task": task,
                        "shape": shape,
                        "cand": name,
                        "ms": ms,
                        "tflops": fl / ms / 1e9,
                        "err": err,
                        "baseline": True,
                    }
                except Exception as e:  # noqa: BLE001
                    rec = {
                        "key": key,
                        "task": task,
                        "shape": shape,
                        "cand": name,
                        "error": f"{type(e).__name__}: {e}"[:200],
                        "baseline": True,
                    }
                emit(rec)
                log(
                    f"{task:18s} {shape:20s} {name:30s} "
                    + (
                        f"{rec['ms']:8.3f} ms {rec['tflops']:7.1f} TF err {rec['err']:.1e}"
                        if "ms" in rec
                        else rec["error"]
                    )
                )
            for fam_name, label, knobs, shapes in CANDIDATES:
                if cand_task(fam_name) != task or shape not in shapes_for(task, shapes):
                    continue
                key = f"{task}|{shape}|{label}"
                if key in skip:
                    continue
                emit({"key": key, "state": "start"})
                _WATCH.update(deadline=time.time() + STEP_LIMIT_S, key=key)
                rec = {"key": key, "task": task, "shape": shape, "cand": label, "family": fam_name, "knobs": knobs}
                try:
                    if DRY and os.environ.get("GPU_CHECK_DRY_HANG") == label:
                        time.sleep(1e6)  # rehearse a hung kernel: the watchdog must end us
                    mod = load_module(module_path(fam_name, knobs))
                    out = mod.run(*inputs)
                    sync()
                    err = rel_err(out, ref)
                    rec["err"] = err
                    del out
                    if not err < REL_TOL:
                        rec["error"] = f"WRONG rel err {err:.3e}"
                    else:
                        ms = bench(functools.partial(mod.run, *inputs))
                        rec.update(ms=ms, tflops=fl / ms / 1e9)
                        # second correctness check on fresh inputs (guards against luck)
                        fresh = make_inputs(task, shape, seed=int(time.time()) % 100000)
                        err2 = rel_err(mod.run(*fresh), reference(task, fresh))
                        rec["err2"] = err2
                        if not err2 < REL_TOL:
                            rec["error"] = f"WRONG on fresh inputs rel err {err2:.3e}"
                        del fresh
                except Exception as e:  # noqa: BLE001
                    rec["error"] = f"{type(e).__name__}: {e}"[:300]
                    traceback.print_exc(limit=1)
                emit(rec)
                if "ms" in rec and "error" not in rec:
                    log(
                        f"{task:18s} {shape:20s} {label:30s} {rec['ms']:8.3f} ms {rec['tflops']:7.1f} TF "
                        f"err {rec['err']:.1e}"
                    )
                else:
                    log(f"{task:18s} {shape:20s} {label:30s} FAILED {rec.get('error')}")
            _WATCH.update(deadline=None, key=None)
            del inputs, ref
            if not DRY:
                torch.cuda.empty_cache()


def read_results():
    recs, started = {}, []
    if RESULTS.exists():
        for line in RESULTS.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:
                continue
            if r.get("state") == "start":
                started.append(r["key"])
            else:
                recs[r["key"]] = r
    return recs, started


def render_table() -> str:
    recs, _ = read_results()
    lines = []
    for task in ("matmul", "attention", "attention_residual"):
        table = MM_SHAPES if task == "matmul" else ATTN_SHAPES
        lines.append(f"\n## {task}   (TFLOP/s; ratio to {'cuBLAS' if task == 'matmul' else 'cuDNN SDPA'})")
        for shape in table:
            rows = [r for r in recs.values() if r.get("task") == task and r.get("shape") == shape]
            if not rows:
                continue
            base_name = "cuBLAS" if task == "matmul" else "cuDNN"
            base = next((r for r in rows if r["cand"] == base_name and "ms" in r), None)
            lines.append(f"{shape}")
            for r in sorted(rows, key=lambda r: (not r.get("baseline", False), -(r.get("tflops") or 0))):
                if "ms" in r and "error" not in r:
                    ratio = f"{base['ms'] / r['ms']:.2f}" if base else "-"
                    lines.append(
                        f"  {r['cand']:30s} {r['ms']:9.3f} ms {r['tflops']:7.1f} TF  x{ratio:5s} err {r['err']:.1e}"
                    )
                else:
                    lines.append(f"  {r['cand']:30s} FAILED {str(r.get('error'))[:90]}")
    return "\n".join(lines)


def summary() -> str:
    recs, _ = read_results()
    out = ["\n## best family point per shape (ratio to cuBLAS / cuDNN)"]
    for task in ("matmul", "attention", "attention_residual"):
        table = MM_SHAPES if task == "matmul" else ATTN_SHAPES
        for shape in table:
            rows = [r for r in recs.values() if r.get("task") == task and r.get("shape") == shape]
            ok = [r for r in rows if not r.get("baseline") and "ms" in r and "error" not in r]
            base_name = "cuBLAS" if task == "matmul" else "cuDNN"
            base = next((r for r in rows if r["cand"] == base_name and "ms" in r), None)
            if not ok:
                continue
            best = min(ok, key=lambda r: r["ms"])
            ratio = f"{base['ms'] / best['ms']:.2f}" if base else "-"
            bt = f"{base['tflops']:.0f}" if base else "-"
            short = {"matmul": "matmul", "attention": "attn", "attention_residual": "attn+res"}[task]
            out.append(f"{short:9s} {shape:20s} {best['cand']:30s} {best['tflops']:6.0f} TF vs {bt:>4s} x{ratio}")
    nfail = sum(1 for r in recs.values() if "error" in r)
    out.append(f"failed measurements: {nfail} of {len(recs)}")
    return "\n".join(out)


def run_step(cmd: list[str], limit: float) -> int:
    limit = max(5, int(limit))
    log(f"[orchestrator] step (timeout {limit}s): {' '.join(cmd[2:])}")
    p = subprocess.run(["timeout", "-k", "5", str(limit), *cmd], env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if p.returncode in (124, 137):
        log(f"[orchestrator] step timed out after {limit}s")
    elif p.returncode != 0:
        log(f"[orchestrator] step exited with {p.returncode}")
    return p.returncode


def mode_orchestrate() -> None:
    t0 = time.time()
    OUT.mkdir(parents=True, exist_ok=True)
    if RESULTS.exists():
        RESULTS.unlink()

    def left() -> float:
        return TOTAL_BUDGET_S - (time.time() - t0)

    if not DRY:
        env_line = subprocess.run(
            [
                "timeout",
                "60",
                sys.executable,
                "-c",
                "import torch, triton; p = torch.cuda.get_device_properties(0); "
                "print('torch', torch.__version__, 'triton', triton.__version__, p.name, "
                "p.multi_processor_count, 'SMs')",
            ],
            capture_output=True,
            text=True,
        ).stdout.strip()
        log(f"[env] {env_line}")
        smi = subprocess.run(
            [
                "timeout",
                "20",
                "nvidia-smi",
                "--query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
        )
        log(f"[env] nvidia-smi: {smi.stdout.strip()}")
    me = [sys.executable, str(Path(__file__).resolve())]
    run_step(
        [*me, "--mode", "precompile", "--workers", "2" if DRY else "14", "--budget", str(min(95.0, left() * 0.35))],
        min(110.0, left() * 0.4),
    )
    plan = [("matmul", 0.45), ("attention", 0.95)]
    for group, share in plan:
        # each group gets a fixed slice; retries (after a hung candidate) stay inside it
        deadline = time.time() + left() * share
        tries = 0
        while tries < 8 and deadline - time.time() > 15:
            tries += 1
            recs, started = read_results()
            skip = set(recs)
            hung = [k for k in started if k not in recs]
            for k in hung:  # a candidate that hung or crashed the process: skip it on every shape
                task, shape, cand = k.split("|")
                table = MM_SHAPES if task == "matmul" else ATTN_SHAPES
                with open(RESULTS, "a") as f:
                    for other in table:
                        key = f"{task}|{other}|{cand}"
                        if key in recs or key in skip:
                            continue
                        why = "hung or crashed the process" if other == shape else f"skipped: hung on {shape}"
                        rec = {"key": key, "task": task, "shape": other, "cand": cand, "error": why}
                        f.write(json.dumps(rec) + "\n")
                        skip.add(key)
            skip_file = OUT / "skip.json"
            skip_file.write_text(json.dumps(sorted(skip)))
            rc = run_step([*me, "--mode", "group", "--group", group, "--skip", str(skip_file)], deadline - time.time())
            if rc in (0, 124, 137):  # done, or its time slice is spent
                break
    table = render_table()
    (OUT / "table.txt").write_text(table + "\n" + summary() + "\n")
    log(table)
    log(summary())
    log(f"[orchestrator] total {time.time() - t0:.1f}s")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="orchestrate", choices=("orchestrate", "precompile", "group"))
    ap.add_argument("--group", choices=sorted(GROUPS))
    ap.add_argument("--skip")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--budget", type=float, default=90.0)
    args = ap.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)
    if args.mode == "orchestrate":
        mode_orchestrate()
    elif args.mode == "precompile":
        mode_precompile(args.workers, args.budget)
    else:
        skip = set(json.loads(Path(args.skip).read_text())) if args.skip else set()
        mode_group(args.group, skip)


if __name__ == "__main__":
    main()
