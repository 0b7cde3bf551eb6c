"""GPU check of the fp8 GEMM families and the softmax start points (H200, one process, < 4 minutes).

  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site:$PWD timeout -k 5 235 python3 scripts/gpu_fp8_check.py --out $OUT
(the wheels from scripts/build_wheels.sh, nvidia-cutlass's headers among them; exit status 1 with "Timeout" in
the output means the watchdog ended it: the files under $OUT are still complete up to the last step.)

Steps (each bounded; progress on stdout with flush; results.json, table.md and log.txt rewritten under
$OUT/gpu_fp8_check/ after every step and every timed shape, so a kill or the watchdog keeps what was measured):
1. correctness: the Triton fp8 points on an odd shape (1000x1160x1000: partial tiles, K padded for TMA),
   blockwise for every point, per-row / per-tensor for a few, against a float64 reference of the scaled
   product on the GPU (the CUTLASS fp8 points and the CUTLASS softmax start build in nvcc threads meanwhile);
2. timing, per-row and per-tensor at 8192^3 and 4096^3, then blockwise at both (with the CUTLASS points):
   family points vs torch._scaled_mm with the same scaling, side by side in one process, every point checked
   against float64 at that shape first: interleaved rounds (order reversed every other round), L2 flushed by
   do_bench before every call, median of the round medians and the spread (max - min) / median;
3. the CUTLASS fp8 points on odd shapes (the launcher pads M, N, K);
4. softmax 4096x32768: the start points (Triton rowblock / online / split_row, CUTLASS when built) vs a
   same-size copy, interleaved the same way;
5. last, because warp-specialized kernels are the ones that have hung a GPU here (the attention points,
   NOTES_compute.md): the warp-specialized persistent point, correctness and timing at 8192^3.
A step that fails is logged with its traceback and the next step runs; a point that fails is a note. New
steps stop starting at --budget-s; at --hard-limit-s a watchdog (faulthandler, no GIL needed) dumps the
stacks and exits, the files under --out holding everything measured until then. Prints the tables last.

Checked on the CPU only (2026-12-01, no GPU there), so still unverified:
- every Triton point here compiles ahead of time for sm_90a (triton 3.6, GPUTarget("cuda", 90, 32), the
  launcher's 8192^3 specialization, blockwise and per-row): e4m3 wgmma (m64nNk32.f32.e4m3.e4m3), TMA loads,
  no local memory (spills), 87-194 registers, 33-213 KB shared, no global scratch (so no triton.set_allocator
  needed); the warp-specialized point has setmaxnreg. The same without divisibility of M, N, K (odd shapes).
- the four CUTLASS fp8 points build with nvcc 13.0 -arch sm_90a against nvidia-cutlass 4.2 (168 registers,
  0 spills; 50-104 s each on this 2-core machine) and the CUTLASS softmax start builds;
- interpreted (TRITON_INTERPRET=1) correctness of the Triton launchers and kernels: tests/families/
  test_fp8_family.py; this script's own Python paths (problem generation, references, tables) ran on the
  CPU with the GPU calls replaced by the interpreter at small sizes (--cpu-smoke).
Not verifiable without a GPU: that the kernels run and are correct on the device (host TMA descriptors,
scale loads, warp specialization not hanging), their speed, whether torch 2.11's _scaled_mm takes the
blockwise scales in these layouts (the checks were read from torch's ScaledBlas.cpp on main, which accepts
scale_a [M, K/128] strides (1, M) and scale_b [K/128, N/128] strides (1, K/128); F.scaled_mm is tried next,
then cuBLAS bf16 on dequantised operands as a marked fallback), nvcc's build time on the GPU host with four
or five builds at once (about a minute each expected on its 16 cores; blockwise timing waits for them until
0.45 x --budget-s, then goes on without), and the Triton JIT compile time there (about 45 compiles; 0.4 s each
with a cold cache here; the budget stops 4096^3 before 8192^3).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

T0 = time.monotonic()
LOG: list[str] = []
OUT_DIR: Path | None = None
DEVICE = "cuda"  # "cpu" under --cpu-smoke (the interpreter)


def log(msg: str) -> None:
    line = f"[fp8-check {time.monotonic() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


def short(e: object, n: int) -> str:
    """An exception's text on one line, at most ``n`` characters (torch's scaling errors span many lines)."""
    return " ".join(str(e).split())[:n]


def elapsed() -> float:
    return time.monotonic() - T0


def save(results: dict) -> None:
    """Rewrite the result files (after every step: a kill or the watchdog keeps what was measured)."""
    if OUT_DIR is None:
        return
    try:
        results["elapsed_s"] = round(elapsed(), 1)
        (OUT_DIR / "results.json").write_text(json.dumps(results, indent=1, default=str))
        (OUT_DIR / "table.md").write_text(table(results) + "\n")
        (OUT_DIR / "log.txt").write_text("\n".join(LOG) + "\n")
    except Exception as e:  # noqa: BLE001 - never let reporting end the run
        print(f"[fp8-check] could not write results: {e}", flush=True)


def guarded(results: dict, name: str, fn, *args, **kwargs) -> None:
    """Run one step; a failure is logged with its traceback and recorded, and the next step runs."""
    t = time.monotonic()
    try:
        fn(results, *args, **kwargs)
    except Exception as e:  # noqa: BLE001 - one step's failure must not lose the others
        log(f"ERROR in {name}: {type(e).__name__}: {short(e, 300)}\n{traceback.format_exc()[-2000:]}")
        results.setdefault("step_errors", {})[name] = f"{type(e).__name__}: {short(e, 300)}"
    results.setdefault("step_seconds", {})[name] = round(time.monotonic() - t, 1)
    save(results)


# family points: blockwise-valid ones (the task's mode), plus two 128x256 tiles that the blockwise register
# model rules out but the per-row / per-tensor kernels (one accumulator) compile without spills
# (AOT for sm_90a: 191-194 registers, no local memory)
BLOCK_POINTS = {
    "pers 128x128 w8 s4": ("fp8_matmul.persistent_tma", dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8,
                                                             num_stages=4)),
    "pers 128x128 w8 s5 sub2": ("fp8_matmul.persistent_tma", dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8,
                                                                  num_stages=5, EPILOGUE_SUBTILE=2)),
    "tiled 128x128 w8 s4": ("fp8_matmul.tiled", dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8,
                                                     num_stages=4)),
    "tiled 64x256 w8 s4": ("fp8_matmul.tiled", dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=4)),
    # two CTAs per SM (98 KB, 160 registers x 128 threads each): one's scale promotion (the wgmma result is
    # waited for every K block) overlaps the other's tensor-core work
    "tiled 64x128 w4 s4": ("fp8_matmul.tiled", dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4, num_stages=4)),
    "pers 64x128 w4 s4 x2": ("fp8_matmul.persistent_tma", dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4,
                                                               num_stages=4, NUM_SMS_MULT=2)),
}  # fmt: skip
OUTER_ONLY = {
    "pers 128x256 w8 s3": ("fp8_matmul.persistent_tma", dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8,
                                                             num_stages=3)),
    "tiled 128x256 w8 s3": ("fp8_matmul.tiled", dict(BLOCK_M=128, BLOCK_N=256, GROUP_M=8, num_warps=8,
                                                     num_stages=3)),
}  # fmt: skip
# warp-specialized: run last (step 5)
WS_POINTS = {
    "pers 64x128 w4 s4 ws": ("fp8_matmul.persistent_tma", dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4,
                                                               num_stages=4, WARP_SPECIALIZE=True)),
}  # fmt: skip
START_POINTS = {"tiled start": ("fp8_matmul.tiled", {}), "pers start": ("fp8_matmul.persistent_tma", {})}
# per-row / per-tensor on the odd shape for these only (each scaling is its own compile; the timing step
# checks every point in every scaling at the timing shapes)
OUTER_ODD = ("tiled start", "pers start", "pers 128x128 w8 s4", "tiled 64x128 w4 s4")
MODES = ("blockwise", "rowwise", "tensorwise")


# CUTLASS fp8 blockwise points (built by nvcc in background threads while the Triton steps run)
CUTLASS_POINTS = {
    "cutlass coop 128x128": {},
    "cutlass coop 128x128 cluster 1x2": {"CLUSTER_N": 2},
    "cutlass coop 128x128 stream-K": {"TILE_SCHEDULER": "stream_k"},
    "cutlass pingpong 64x128": {"SCHEDULE": "pingpong", "BLOCK_M": 64},
}


def build_cutlass_fp8(label: str, knobs: dict, box: dict) -> None:
    try:
        from kernelarc.cutlass import available

        if not available():
            box[label] = "nvcc or the CUTLASS headers not found"
            return
        from kernelarc.families.cutlass_fp8_gemm import CUTLASS_FP8_GEMM as fam
        from kernelarc.tasks.inputs import load_module

        t = time.monotonic()
        box[label] = load_module(fam.render(fam.check_point(knobs)), "cutlass_fp8_" + str(abs(hash(label))))
        log(f"  built {label} in {time.monotonic() - t:.0f} s")
    except Exception as e:  # noqa: BLE001
        box[label] = f"{type(e).__name__}: {short(e, 300)}"


def load_point(fam_name: str, knobs: dict):
    from kernelarc.families import get_family
    from kernelarc.tasks.inputs import load_module

    fam = get_family(fam_name)
    k = fam.check_point(knobs)
    return load_module(fam.render(k), fam_name.replace(".", "_")), fam.valid(k)


def quantize(x, block_rows):
    import torch

    rows, cols = x.shape
    rp, cp = -(-rows // block_rows) * block_rows, -(-cols // 128) * 128
    xp = torch.zeros(rp, cp, device=x.device, dtype=torch.float32)
    xp[:rows, :cols] = x
    scale = (xp.reshape(rp // block_rows, block_rows, cp // 128, 128).abs().amax(dim=(1, 3)) / 448).clamp(min=1e-12)
    full = scale.repeat_interleave(block_rows, 0).repeat_interleave(128, 1)[:rows, :cols]
    return (x / full).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def make_problem(M, N, K, mode, seed=0):
    """fp8 operands and scales of one scaling mode; magnitudes vary by row and by weight block."""
    import torch

    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(M, K, device=DEVICE, generator=g) * torch.exp(torch.randn(M, 1, device=DEVICE, generator=g))
    w = torch.randn(N, K, device=DEVICE, generator=g)
    if mode == "blockwise":
        w *= (
            torch.exp(torch.randn(-(-N // 128), -(-K // 128), device=DEVICE, generator=g))
            .repeat_interleave(128, 0)
            .repeat_interleave(128, 1)[:N, :K]
        )
        A, sa = quantize(x, 1)
        B, sb = quantize(w, 128)
    elif mode == "rowwise":
        sa = (x.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        sb = (w.abs().amax(dim=1, keepdim=True) / 448).clamp(min=1e-12)
        A, B = (x / sa).clamp(-448, 448).to(torch.float8_e4m3fn), (w / sb).clamp(-448, 448).to(torch.float8_e4m3fn)
        sb = sb.reshape(1, N).contiguous()
    else:
        sa = (x.abs().amax() / 448).clamp(min=1e-12).reshape(())
        sb = (w.abs().amax() / 448).clamp(min=1e-12).reshape(())
        A, B = (x / sa).to(torch.float8_e4m3fn), (w / sb).to(torch.float8_e4m3fn)
    return A, B, sa.float(), sb.float()


def ref64(A, B, sa, sb, mode):
    M, K = A.shape
    N = B.shape[0]
    a, b = A.double(), B.double()
    if mode == "blockwise":
        a = a * sa.double().repeat_interleave(128, 1)[:, :K]
        b = b * sb.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]
    else:
        a = a * sa.double().reshape(-1, 1)
        b = b * sb.double().reshape(-1, 1)
    return a @ b.T


def rel_err(out, ref) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def scaled_mm_variants(A, B, sa, sb, mode):
    """torch._scaled_mm (and F.scaled_mm) calls with the same scaling, in the layouts torch documents;
    the GPU run keeps the first one that is correct. Building a variant never raises (an API missing from
    this torch is a note, not a crash): each is a zero-argument callable."""
    import torch
    import torch.nn.functional as F

    Bt = B.t()  # (K, N) column-major, as cuBLAS wants the second operand
    out = {}
    if mode == "blockwise":
        # torch's checks (ScaledBlas.cpp, is_blockwise_1x128_scaling / _128x128_scaling, with b.t() and
        # scale_b.t()): scale_a [M, K/128] with strides (1, M); scale_b.t() [N/128, K/128] contiguous
        KB = sa.shape[1]
        NB = sb.shape[0]
        sa_mmajor = sa.t().contiguous().t()  # [M, K/128] with stride (1, M)
        out["_scaled_mm blockwise"] = lambda: torch._scaled_mm(A, Bt, scale_a=sa_mmajor, scale_b=sb.t(),
                                                               out_dtype=torch.bfloat16)  # fmt: skip
        sbc = sb.t().contiguous()
        out["_scaled_mm blockwise (sb contiguous)"] = lambda: torch._scaled_mm(
            A, Bt, scale_a=sa_mmajor, scale_b=sbc, out_dtype=torch.bfloat16
        )
        st = getattr(F, "ScalingType", None)
        if hasattr(F, "scaled_mm") and st is not None and hasattr(st, "BlockWise1x128"):
            L4 = -(-KB // 4) * 4
            sbp = torch.zeros(NB, L4, device=sb.device, dtype=torch.float32)
            sbp[:, :KB] = sb
            sb_v2 = sbp.t()  # [L4, N/128] with stride (1, L4)
            out["F.scaled_mm blockwise"] = lambda: F.scaled_mm(
                A, Bt, sa_mmajor, st.BlockWise1x128, sb_v2, st.BlockWise128x128, output_dtype=torch.bfloat16
            )
    else:
        for fast in (False, True):
            out[f"_scaled_mm {mode} fast_accum={fast}"] = (
                lambda fast=fast: torch._scaled_mm(
                    A, Bt, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast
                )  # fmt: skip
            )
    return out


def dequant_bf16_fallback(A, B, sa, sb, mode):
    """Where no torch._scaled_mm form takes these scales: cuBLAS bf16 on operands dequantised beforehand
    (the dequantisation untimed), so the baseline is a bf16 GEMM, not an fp8 one: say so in the table."""
    import torch

    K = A.shape[1]
    N = B.shape[0]
    if mode == "blockwise":
        a = (A.float() * sa.repeat_interleave(128, 1)[:, :K]).to(torch.bfloat16)
        b = (B.float() * sb.repeat_interleave(128, 0).repeat_interleave(128, 1)[:N, :K]).to(torch.bfloat16)
    else:
        a = (A.float() * sa.reshape(-1, 1)).to(torch.bfloat16)
        b = (B.float() * sb.reshape(-1, 1)).to(torch.bfloat16)
    return lambda: torch.matmul(a, b.T)


def interleaved(fns: dict, rounds: int, warmup: int = 10, rep: int = 40) -> dict:
    """Median over rounds of do_bench medians (L2 flushed before every call), and the spread."""
    if DEVICE == "cuda":
        from triton.testing import do_bench
    else:  # --cpu-smoke: one wall-clock call per round (do_bench needs a GPU driver)

        def do_bench(f, warmup, rep, return_mode):
            t = time.perf_counter()
            f()
            return (time.perf_counter() - t) * 1e3

    times: dict[str, list[float]] = {n: [] for n in fns}
    errors: dict[str, str] = {}
    for r in range(rounds):
        for name, f in list(fns.items())[:: -1 if r % 2 else 1]:
            if name in errors:
                continue
            try:
                times[name].append(do_bench(f, warmup=warmup, rep=rep, return_mode="median"))
            except Exception as e:  # noqa: BLE001 - a failing call is reported, not fatal
                errors[name] = f"{type(e).__name__}: {short(e, 300)}"
    res = {}
    for name, ts in times.items():
        if ts:
            med = statistics.median(ts)
            res[name] = {"ms": med, "spread": (max(ts) - min(ts)) / med, "rounds_ms": ts}
        else:
            res[name] = {"error": errors.get(name, "no measurement")}
    return res


def sync() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


# error-norm bounds against float64: blockwise promotes every 128-deep K block to fp32; per-row / per-tensor
# accumulate the whole K loop in the tensor cores (Triton's default on sm_90, max_num_imprecise_acc 2^30, like
# use_fast_accum=True), whose fp8 sums keep about 14 bits (DeepSeek-V3 report), never measured here: a looser
# bound, still far below the O(1) error of a wrong scale
TOL_NORM = {"blockwise": 1e-2, "rowwise": 2e-2, "tensorwise": 2e-2}


def errors_of(out, ref, mode: str) -> tuple[float, float, bool]:
    """(relative error norm, worst element error over max |ref|, ok) of an output against float64."""
    import torch

    o = out.double()
    e = ((o - ref).norm() / ref.norm()).item()
    elem = ((o - ref).abs().max() / ref.abs().max()).item()
    return e, elem, bool(torch.isfinite(o).all()) and e < TOL_NORM[mode] and elem < 3e-2


def check_point(rows: list, label: str, run, A, B, sa, sb, ref, shape, mode) -> bool:
    """One point on one problem against the float64 reference; a row for the table, a log line on failure."""
    try:
        out = run(A, B, sa, sb)
        sync()
        e, elem, ok = errors_of(out, ref, mode)
        err = None if ok else f"rel err {e:.2e}, worst element {elem:.2e} of max |ref|"
    except Exception as ex:  # noqa: BLE001 - one point's failure is a row, not the end of the step
        e, elem, ok, err = float("nan"), float("nan"), False, f"{type(ex).__name__}: {short(ex, 300)}"
    if err:
        log(f"  {label} {shape} {mode}: {err}")
    rows.append({"point": label, "shape": shape, "mode": mode, "rel_err": e, "elem_err": elem, "ok": ok,
                 "error": err})  # fmt: skip
    return ok


def step_correctness(results: dict, points: dict, shape, outer: tuple, budget_s: float) -> None:
    """``points`` on ``shape`` in the blockwise mode, and per-row / per-tensor for the labels in ``outer``."""
    rows = results.setdefault("correctness", [])
    log(f"correctness of {len(points)} Triton points on {shape} against a float64 reference")
    for mode in MODES:
        todo = {k: v for k, v in points.items() if mode == "blockwise" or k in outer}
        if not todo:
            continue
        A, B, sa, sb = make_problem(*shape, mode, seed=1)
        ref = ref64(A, B, sa, sb, mode)
        n_ok = 0
        for label, (fam, knobs) in todo.items():
            if elapsed() > budget_s:
                log(f"  correctness budget spent ({budget_s:.0f} s): {label} {mode} and later skipped")
                return
            t = time.monotonic()
            try:
                mod, _ = load_point(fam, knobs)
            except Exception as ex:  # noqa: BLE001
                rows.append({"point": label, "shape": shape, "mode": mode, "ok": False,
                             "error": f"render/load: {type(ex).__name__}: {short(ex, 300)}"})  # fmt: skip
                log(f"  {label}: render/load failed: {ex}")
                continue
            n_ok += check_point(rows, label, mod.run, A, B, sa, sb, ref, shape, mode)
            log(f"  {label} {mode}: {'ok' if rows[-1]['ok'] else 'FAILED'} ({time.monotonic() - t:.1f} s)")
        log(f"  {shape} {mode}: {n_ok}/{len(todo)} correct")
        save(results)


def step_cutlass_correctness(results: dict, cutlass_mods: dict, shapes) -> None:
    """The CUTLASS blockwise points on odd shapes (M, N, K padded by the launcher) and at 4096^3."""
    rows = results.setdefault("correctness", [])
    built = {k: m for k, m in cutlass_mods.items() if not isinstance(m, str)}
    log(f"CUTLASS fp8 correctness: {len(built)} built; not built: "
        f"{ {k: v for k, v in cutlass_mods.items() if isinstance(v, str)} }")  # fmt: skip
    for shape in shapes:
        if not built:
            break
        A, B, sa, sb = make_problem(*shape, "blockwise", seed=2)
        ref = ref64(A, B, sa, sb, "blockwise")
        for label, mod in built.items():
            check_point(rows, label, mod.run, A, B, sa, sb, ref, shape, "blockwise")
    done = [r for r in rows if r["point"].startswith("cutlass")]
    log(f"  CUTLASS: {sum(r['ok'] for r in done)}/{len(done)} correct")


def library_fns(A, B, sa, sb, mode, ref, notes: dict) -> dict:
    """The torch._scaled_mm forms that take these scales and match the reference; where none does, the
    dequantised bf16 fallback, marked as such."""
    fns = {}
    for name, f in scaled_mm_variants(A, B, sa, sb, mode).items():
        try:
            out = f()
            sync()
            e = rel_err(out, ref)
            if e < 2e-2:
                fns["lib: " + name] = f
                if mode == "blockwise":
                    break  # one working blockwise layout is the baseline
            else:
                notes[name] = f"wrong result (rel err {e:.2e})"
        except Exception as ex:  # noqa: BLE001 - torch's reason (sizes and strides it got) is at the end
            msg = short(ex, 100000)
            notes[name] = f"{type(ex).__name__}: " + (msg if len(msg) < 600 else f"{msg[:200]} ... {msg[-380:]}")
    if not fns:
        try:
            f = dequant_bf16_fallback(A, B, sa, sb, mode)
            f()
            fns["lib: FALLBACK cuBLAS bf16 on dequantised operands (not fp8)"] = f
        except Exception as ex:  # noqa: BLE001
            notes["fallback"] = f"{type(ex).__name__}: {short(ex, 200)}"
    return fns


def step_timing(results: dict, shapes, rounds: int, budget_s: float, points: dict, cutlass_box: dict,
                outer_points: dict, tag: str = "", before_blockwise=None) -> None:  # fmt: skip
    """Per-row and per-tensor at every shape first (Triton only), then blockwise with the CUTLASS points, so
    the nvcc builds have that much more time; ``before_blockwise()`` runs once, before the first blockwise."""
    import torch

    log(f"timing{tag} vs torch._scaled_mm, {rounds} interleaved rounds")
    timing = results.setdefault("timing", {})
    rows = results.setdefault("correctness", [])
    combos = [(shape, mode) for shape in shapes for mode in ("rowwise", "tensorwise")]
    for shape, mode in combos + [(shape, "blockwise") for shape in shapes]:
        M, N, K = shape
        flops = 2 * M * N * K
        if elapsed() > budget_s:
            log(f"  timing budget spent ({budget_s:.0f} s): {shape} {mode} and later skipped")
            return
        if mode == "blockwise" and before_blockwise is not None:
            before_blockwise()
            before_blockwise = None
        t_combo = time.monotonic()
        A, B, sa, sb = make_problem(M, N, K, mode)
        ref = ref64(A, B, sa, sb, mode)
        notes: dict = {}
        fns = library_fns(A, B, sa, sb, mode, ref, notes)
        pts = dict(points)
        if mode != "blockwise":
            pts.update(outer_points)
        cands = {}
        if mode == "blockwise":
            # the builds' box is live: a build that finished after step 2 is timed too (checked first)
            for label in cutlass_box.get("labels", ()):
                mod = cutlass_box.get(label, "build not finished by then")
                if isinstance(mod, str):
                    notes[label] = mod
                else:
                    cands[label] = mod.run
        for label, (fam, knobs) in pts.items():
            try:
                cands[label] = load_point(fam, knobs)[0].run
            except Exception as ex:  # noqa: BLE001
                notes[label] = f"render/load: {type(ex).__name__}: {short(ex, 200)}"
        for label, run in cands.items():
            if check_point(rows, label, run, A, B, sa, sb, ref, shape, mode):
                fns[label] = lambda run=run, A=A, B=B, sa=sa, sb=sb: run(A, B, sa, sb)
            else:
                notes[label] = rows[-1]["error"]
        del ref
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
        t_bench = time.monotonic()
        t = interleaved(fns, rounds)
        for v in t.values():
            if "ms" in v:
                v["tflops"] = flops / (v["ms"] * 1e-3) / 1e12
        lib = {n: v for n, v in t.items() if n.startswith("lib:") and "ms" in v}
        best_lib = min(lib, key=lambda n: lib[n]["ms"]) if lib else None
        ours = {n: v for n, v in t.items() if not n.startswith("lib:") and "ms" in v}
        best = min(ours, key=lambda n: ours[n]["ms"]) if ours else None
        if best_lib:
            for v in ours.values():
                v["vs_lib"] = lib[best_lib]["ms"] / v["ms"]
        key = f"{M}x{N}x{K} {mode}{tag}"
        timing[key] = {"fns": t, "notes": notes, "best_ours": best, "best_lib": best_lib,
                       "best_lib_ms": lib[best_lib]["ms"] if best_lib else None}  # fmt: skip
        took = f"({t_bench - t_combo:.0f} s compile + check, {time.monotonic() - t_bench:.0f} s timing)"
        if best and best_lib:
            log(f"  {key}: best ours {best} {ours[best]['ms']:.4f} ms ({ours[best]['tflops']:.0f} TFLOP/s, "
                f"spread {ours[best]['spread']:.1%}), best lib {best_lib[5:]} {lib[best_lib]['ms']:.4f} ms "
                f"-> {ours[best]['vs_lib']:.3f}x {took}")  # fmt: skip
        else:
            log(f"  {key}: incomplete {took}")
        for n, msg in notes.items():
            log(f"    note {n}: {msg}")
        save(results)


def step_softmax(results: dict, cutlass_box: dict, rounds: int, shape) -> None:
    import torch
    import torch.nn.functional as F

    from kernelarc.families import get_family
    from kernelarc.tasks.inputs import load_module

    M, N = shape
    log(f"softmax {M}x{N}: start points vs a same-size copy")
    x = torch.randn(M, N, device=DEVICE, dtype=torch.bfloat16)
    ref = torch.softmax(x.double(), dim=-1)
    nbytes = 2 * x.numel() * x.element_size()
    fns, mods, errs = {}, {}, {}
    for name in ("softmax.rowblock", "softmax.online", "softmax.split_row"):
        try:
            fam = get_family(name)
            mods[name] = (load_module(fam.render(fam.start), name.replace(".", "_")), dict(fam.start))
        except Exception as ex:  # noqa: BLE001
            errs[name] = f"render/load: {type(ex).__name__}: {short(ex, 200)}"
    if "mod" in cutlass_box:
        from kernelarc.families.cutlass_softmax import CUTLASS_SOFTMAX

        mods["softmax.cutlass_sm90"] = (cutlass_box["mod"], dict(CUTLASS_SOFTMAX.start))
    else:
        errs["softmax.cutlass_sm90"] = f"not timed ({cutlass_box.get('error', 'build not finished')})"
    for name, (mod, start) in mods.items():
        try:
            y = mod.run(x)
            sync()
            err = ((y.double() - ref).abs() / (ref.abs() + 1e-30)).max().item()
        except Exception as ex:  # noqa: BLE001 - one kernel's failure leaves the others timed
            errs[name] = f"{type(ex).__name__}: {short(ex, 200)}"
            continue
        log(f"  {name} start {start}: max rel err {err:.2e}")
        if err > 2**-6:
            errs[name] = f"max rel err {err:.2e}: not timed"
            continue
        fns[name + " start"] = lambda mod=mod: mod.run(x)
    for n, e in errs.items():
        log(f"  {n}: {e}")
    src = x.view(-1).clone()
    dst = torch.empty_like(src)
    fns["same-size copy"] = lambda: dst.copy_(src)
    fns["torch.softmax (fp32 math)"] = lambda: F.softmax(x.float(), dim=-1).to(x.dtype)
    t = interleaved(fns, rounds, warmup=10, rep=50)
    copy = t["same-size copy"].get("ms")
    for v in t.values():
        if "ms" in v:
            v["tbps"] = nbytes / (v["ms"] * 1e-3) / 1e12
            v["of_copy"] = copy / v["ms"] if copy else None
    results["softmax"] = {"shape": [M, N], "fns": t, "errors": errs}


def build_cutlass_softmax(box: dict) -> None:
    """Runs in a thread from the start: the nvcc build overlaps the fp8 steps."""
    try:
        from kernelarc.cutlass import available

        if not available():
            box["error"] = "nvcc or the CUTLASS headers not found"
            return
        from kernelarc.families.cutlass_softmax import CUTLASS_SOFTMAX
        from kernelarc.tasks.inputs import load_module

        t = time.monotonic()
        box["mod"] = load_module(CUTLASS_SOFTMAX.render(CUTLASS_SOFTMAX.start), "cutlass_softmax_start")
        log(f"  built softmax.cutlass_sm90 start in {time.monotonic() - t:.0f} s")
    except Exception as e:  # noqa: BLE001
        box["error"] = f"{type(e).__name__}: {short(e, 300)}"


def table(results: dict) -> str:
    lines = ["", f"== fp8 GEMM vs torch._scaled_mm ({results.get('device')}, torch {results.get('torch')}, triton "
             f"{results.get('triton')}, {results.get('date')}, commit {results.get('commit')}; median of interleaved "
             f"rounds; spread = (max-min)/median) =="]  # fmt: skip
    lines.append("| shape / scaling | best KernelArc point | ms | TFLOP/s | spread | best library call | ms | ratio |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for key, r in results.get("timing", {}).items():
        fns = r["fns"]
        lb = r.get("best_lib")
        li = fns.get(lb) if lb else None
        ours = sorted((n for n, v in fns.items() if not n.startswith("lib:") and "ms" in v), key=lambda n: fns[n]["ms"])
        # the best point, and the best of the other kind (Triton / CUTLASS) when it is not the best
        shown = ours[:1] + [n for n in ours[1:] if n.startswith("cutlass") != ours[0].startswith("cutlass")][:1]
        lib_txt = f"{lb[5:]} | {li['ms']:.4f} (spread {li['spread']:.1%})" if li else "no working call (notes) | -"
        if not shown:
            lines.append(f"| {key} | none measured | - | - | - | {lib_txt} | - |")
        for n in shown:
            o = fns[n]
            ratio = f"{li['ms'] / o['ms']:.3f}x" if li else "-"
            lines.append(
                f"| {key} | {n} | {o['ms']:.4f} | {o['tflops']:.0f} | {o['spread']:.1%} | {lib_txt} | {ratio} |"
            )
    if results.get("timing"):
        lines.append("\nevery timed call (ms, TFLOP/s, spread, ratio best library / this):")
        for key, r in results["timing"].items():
            parts = []
            for n, v in sorted(r["fns"].items(), key=lambda kv: kv[1].get("ms", 1e9)):
                if "ms" in v:
                    vs = f" {v['vs_lib']:.3f}x" if "vs_lib" in v else ""
                    parts.append(f"{n} {v['ms']:.4f}/{v['tflops']:.0f}/{v['spread']:.1%}{vs}")
                else:
                    parts.append(f"{n} ERROR {v.get('error')}")
            lines.append(f"- {key}: " + "; ".join(parts))
            for n, msg in r.get("notes", {}).items():
                lines.append(f"  - note {n}: {msg}")
    corr = results.get("correctness", [])
    if corr:
        bad = [r for r in corr if not r["ok"]]
        worst = {m: max((r["rel_err"] for r in corr if r["ok"] and r["mode"] == m), default=float("nan"))
                 for m in MODES}  # fmt: skip
        lines.append(f"\ncorrectness: {len(corr) - len(bad)}/{len(corr)} point x shape x scaling cases within "
                     f"{TOL_NORM} (error norm) and 3e-2 (worst element / max |ref|) of float64; worst passing "
                     f"error norm per scaling {json.dumps({m: f'{w:.2e}' for m, w in worst.items()})}")  # fmt: skip
        for r in bad:
            lines.append(f"- FAILED {r['point']} {r['shape']} {r['mode']}: {r.get('error')}")
    sm = results.get("softmax")
    if sm:
        lines.append(f"\n== softmax {sm['shape'][0]}x{sm['shape'][1]} (start points) ==")
        lines.append("| kernel | ms | TB/s | of same-size copy | spread |")
        lines.append("|---|---|---|---|---|")
        for n, v in sm["fns"].items():
            if "ms" in v:
                oc = f"{v['of_copy']:.0%}" if v.get("of_copy") else "-"
                lines.append(f"| {n} | {v['ms']:.4f} | {v['tbps']:.2f} | {oc} | {v['spread']:.1%} |")
            else:
                lines.append(f"| {n} | error: {v.get('error')} | | | |")
        for n, e in sm.get("errors", {}).items():
            lines.append(f"- {n}: {e}")
    if results.get("step_errors"):
        lines.append(f"\nstep errors: {json.dumps(results['step_errors'])}")
    lines.append(f"step seconds: {json.dumps(results.get('step_seconds', {}))}; total {elapsed():.0f} s")
    return "\n".join(lines)


def _commit() -> str | None:
    """The checkout's commit where git and .git are there (the device machine's copy may lack them)."""
    import subprocess

    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)  # fmt: skip
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def main() -> None:
    global OUT_DIR, DEVICE
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=190.0, help="no new step or timed shape starts after this")
    ap.add_argument("--hard-limit-s", type=float, default=225.0, help="watchdog: dump stacks and exit after this")
    ap.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="tiny shapes on CPU tensors under TRITON_INTERPRET=1: checks this script's own paths",
    )
    args = ap.parse_args()
    OUT_DIR = Path(args.out) / "gpu_fp8_check"
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    # C-level watchdog: fires even while the main thread waits on the GPU; the files were saved at each step
    faulthandler.dump_traceback_later(args.hard_limit_s, exit=True)
    import torch
    import triton

    if args.cpu_smoke:
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise SystemExit("--cpu-smoke needs TRITON_INTERPRET=1 in the environment")
        DEVICE = "cpu"
        odd, timing_shapes, softmax_shape = (40, 72, 136), [(128, 128, 256), (64, 128, 128)], (8, 1024)
        cutlass_odd = [(40, 200, 136)]
    else:
        if not torch.cuda.is_available():
            raise SystemExit("needs a CUDA GPU (or --cpu-smoke)")
        odd, timing_shapes, softmax_shape = (1000, 1160, 1000), [(8192, 8192, 8192), (4096, 4096, 4096)], (4096, 32768)
        cutlass_odd = [(1000, 1160, 1000), (77, 4096, 520)]  # (the timing shapes are checked before timing)
    results: dict = {
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu (interpreter smoke run)",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "budget_s": args.budget_s,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": _commit(),
    }
    log(f"{results}")
    save(results)
    B = args.budget_s
    box: dict = {}
    fp8_box: dict = {}
    builders = [threading.Thread(target=build_cutlass_softmax, args=(box,), daemon=True)]
    builders += [threading.Thread(target=build_cutlass_fp8, args=(label, knobs, fp8_box), daemon=True)
                 for label, knobs in CUTLASS_POINTS.items()]  # fmt: skip
    for b in builders:
        b.start()
    points = {**START_POINTS, **BLOCK_POINTS}
    guarded(results, "1 correctness", step_correctness, points, odd, OUTER_ODD, budget_s=0.35 * B)

    def wait_for_cutlass() -> None:  # before the first blockwise timing: the builds had steps 1-2's time
        deadline = T0 + 0.45 * B
        for b in builders[1:]:
            b.join(timeout=max(0.0, deadline - time.monotonic()))
        results["cutlass_builds"] = {k: "built" if k in fp8_box and not isinstance(fp8_box[k], str)
                                     else fp8_box.get(k, "not finished") for k in CUTLASS_POINTS}  # fmt: skip
        log(f"CUTLASS fp8 builds at {elapsed():.0f} s: {results['cutlass_builds']}")

    fp8_box["labels"] = tuple(CUTLASS_POINTS)
    guarded(results, "2 timing", step_timing, timing_shapes, args.rounds, 0.75 * B, BLOCK_POINTS, fp8_box,
            OUTER_ONLY, before_blockwise=wait_for_cutlass)  # fmt: skip
    if "cutlass_builds" not in results:
        wait_for_cutlass()
    cutlass_mods = {k: fp8_box.get(k, "build not finished within the budget") for k in CUTLASS_POINTS}
    if elapsed() < 0.8 * B:
        guarded(results, "3 cutlass correctness", step_cutlass_correctness, cutlass_mods, cutlass_odd)
    if elapsed() < 0.85 * B:
        builders[0].join(timeout=max(0.0, min(20.0, 0.85 * B - elapsed())))
        guarded(results, "4 softmax", step_softmax, box, 3, softmax_shape)
    else:
        log("softmax step skipped: budget spent")
    if elapsed() < 0.9 * B:
        guarded(results, "5 ws correctness", step_correctness, WS_POINTS, odd, tuple(WS_POINTS), budget_s=0.93 * B)
        guarded(results, "5 ws timing", step_timing, timing_shapes[:1], 3, 0.95 * B, WS_POINTS, {}, {},
                tag=" [warp-specialized]")  # fmt: skip
    else:
        log("warp-specialized step skipped: budget spent")
    faulthandler.cancel_dump_traceback_later()
    results["cutlass_builds_at_end"] = {k: "built" if k in fp8_box and not isinstance(fp8_box[k], str)
                                        else fp8_box.get(k, "not finished") for k in CUTLASS_POINTS}  # fmt: skip
    results["cutlass_softmax_build"] = "built" if "mod" in box else box.get("error", "not finished")
    save(results)
    log(f"wrote {OUT_DIR}/results.json, table.md, log.txt")
    try:
        print(table(results), flush=True)
    except Exception as e:  # noqa: BLE001 - the files are written; the raw results are in results.json
        log(f"table failed: {type(e).__name__}: {short(e, 300)}")


if __name__ == "__main__":
    main()
