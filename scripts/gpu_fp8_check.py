"""GPU check of the fp8 GEMM families and the softmax start points (H200, one process, < 4 minutes).

  PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_fp8_check.py --out $OUT

Steps (each bounded; progress on stdout; everything also in $OUT/gpu_fp8_check/):
1. correctness: the fp8 family points on odd shapes (and again at the timing shapes before timing),
   blockwise / per-row / per-tensor scales, against a float64 reference of the scaled product on the GPU;
2. timing at 8192^3 and 4096^3: family points vs torch._scaled_mm with the same scaling, side by side in
   one process: interleaved rounds (order reversed every other round), L2 flushed by do_bench before every
   call, median of the round medians and the spread (max - min) / median;
   (the CUTLASS fp8 blockwise family's points too, built by nvcc in threads while step 1 runs);
3. softmax 4096x32768: the new start points (Triton rowblock / online / split_row, CUTLASS when it builds)
   vs a same-size copy, interleaved the same way.
Prints a short table last.
"""

from __future__ import annotations

import argparse
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


def log(msg: str) -> None:
    line = f"[fp8-check {time.monotonic() - T0:6.1f}s] {msg}"
    LOG.append(line)
    print(line, flush=True)


# family points: blockwise-valid ones (the task's mode), plus two 128x256 tiles that the blockwise register
# model rules out but the per-row / per-tensor kernels (one accumulator) compile without spills
BLOCK_POINTS = {
    "pers 128x128 w8 s4": ("fp8_matmul.persistent_tma", dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8,
                                                             num_stages=4)),
    "pers 128x128 w8 s5 sub2": ("fp8_matmul.persistent_tma", dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8,
                                                                  num_stages=5, EPILOGUE_SUBTILE=2)),
    "pers 64x128 w4 s4 ws": ("fp8_matmul.persistent_tma", dict(BLOCK_M=64, BLOCK_N=128, GROUP_M=8, num_warps=4,
                                                               num_stages=4, WARP_SPECIALIZE=True)),
    "tiled 128x128 w8 s4": ("fp8_matmul.tiled", dict(BLOCK_M=128, BLOCK_N=128, GROUP_M=8, num_warps=8,
                                                     num_stages=4)),
    "tiled 64x256 w8 s4": ("fp8_matmul.tiled", dict(BLOCK_M=64, BLOCK_N=256, GROUP_M=8, num_warps=8, num_stages=4)),
    # two CTAs per SM (98 KB, 152 registers x 128 threads each): one's scale promotion (the wgmma result is
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
        box[label] = f"{type(e).__name__}: {str(e)[:300]}"


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

    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g) * torch.exp(torch.randn(M, 1, device="cuda", generator=g))
    w = torch.randn(N, K, device="cuda", generator=g)
    if mode == "blockwise":
        w *= (
            torch.exp(torch.randn(-(-N // 128), -(-K // 128), device="cuda", generator=g))
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
    the GPU run keeps the first one that is correct."""
    import torch
    import torch.nn.functional as F

    Bt = B.t()  # (K, N) column-major, as cuBLAS wants the second operand
    out = {}
    if mode == "blockwise":
        M, KB = sa.shape
        NB = sb.shape[0]
        sa_mmajor = sa.t().contiguous().t()  # [M, K/128] with stride (1, M)
        out["_scaled_mm blockwise"] = lambda: torch._scaled_mm(A, Bt, scale_a=sa_mmajor, scale_b=sb.t(),
                                                               out_dtype=torch.bfloat16)  # fmt: skip
        sbc = sb.t().contiguous()
        out["_scaled_mm blockwise (sb contiguous)"] = lambda: torch._scaled_mm(
            A, Bt, scale_a=sa_mmajor, scale_b=sbc, out_dtype=torch.bfloat16
        )
        if hasattr(F, "scaled_mm"):
            L4 = -(-KB // 4) * 4
            sbp = torch.zeros(NB, L4, device=sb.device, dtype=torch.float32)
            sbp[:, :KB] = sb
            sb_v2 = sbp.t()  # [L4, N/128] with stride (1, L4)
            st = F.ScalingType
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


def interleaved(fns: dict, rounds: int, warmup: int = 10, rep: int = 40) -> dict:
    """Median over rounds of do_bench medians (L2 flushed before every call), and the spread."""
    from triton.testing import do_bench

    times: dict[str, list[float]] = {n: [] for n in fns}
    errors: dict[str, str] = {}
    for r in range(rounds):
        for name, f in list(fns.items())[:: -1 if r % 2 else 1]:
            if name in errors:
                continue
            try:
                times[name].append(do_bench(f, warmup=warmup, rep=rep, return_mode="median"))
            except Exception as e:  # noqa: BLE001 - a failing call is reported, not fatal
                errors[name] = f"{type(e).__name__}: {e}"[:300]
    res = {}
    for name, ts in times.items():
        if ts:
            med = statistics.median(ts)
            res[name] = {"ms": med, "spread": (max(ts) - min(ts)) / med, "rounds_ms": ts}
        else:
            res[name] = {"error": errors.get(name, "no measurement")}
    return res


def step_correctness(results: dict, budget_s: float) -> None:
    import torch

    log("step 1: correctness against a float64 reference on the GPU")
    rows = []
    points = {"tiled start": ("fp8_matmul.tiled", {}), "pers start": ("fp8_matmul.persistent_tma", {})}
    points.update(BLOCK_POINTS)
    # an odd shape here (partial tiles, K padded for TMA); the timing step checks every point again at its
    # shapes before timing it (those rows are added to the same list)
    for shape in ((1000, 1160, 1000),):
        for mode in ("blockwise", "rowwise", "tensorwise"):
            A, B, sa, sb = make_problem(*shape, mode, seed=1)
            ref = ref64(A, B, sa, sb, mode)
            for label, (fam, knobs) in points.items():
                if time.monotonic() - T0 > budget_s:
                    log("  correctness budget spent, rest skipped")
                    results["correctness"] = rows
                    return
                try:
                    mod, _ = load_point(fam, knobs)
                    out = mod.run(A, B, sa, sb)
                    torch.cuda.synchronize()
                    e = rel_err(out, ref)
                    ok = bool(torch.isfinite(out).all()) and e < 1e-2
                except Exception as ex:  # noqa: BLE001
                    e, ok = float("nan"), False
                    log(f"  {label} {shape} {mode}: {type(ex).__name__}: {str(ex)[:300]}")
                rows.append({"point": label, "shape": shape, "mode": mode, "rel_err": e, "ok": ok})
            bad = [r for r in rows if r["shape"] == shape and r["mode"] == mode and not r["ok"]]
            log(f"  {shape} {mode}: {len(points) - len(bad)}/{len(points)} correct"
                + (f" (failed: {[r['point'] for r in bad]})" if bad else ""))  # fmt: skip
    results["correctness"] = rows


def step_cutlass_correctness(results: dict, cutlass_mods: dict) -> None:
    """The CUTLASS blockwise points on odd shapes (M, N, K padded by the launcher) and at 4096^3."""
    import torch

    rows = results.setdefault("correctness", [])
    for shape in ((1000, 1160, 1000), (77, 4096, 520), (4096, 4096, 4096)):
        A, B, sa, sb = make_problem(*shape, "blockwise", seed=2)
        ref = ref64(A, B, sa, sb, "blockwise")
        for label, mod in cutlass_mods.items():
            if isinstance(mod, str):
                continue
            try:
                out = mod.run(A, B, sa, sb)
                torch.cuda.synchronize()
                e = rel_err(out, ref)
                ok = bool(torch.isfinite(out).all()) and e < 1e-2
            except Exception as ex:  # noqa: BLE001
                e, ok = float("nan"), False
                log(f"  {label} {shape}: {type(ex).__name__}: {str(ex)[:300]}")
            rows.append({"point": label, "shape": shape, "mode": "blockwise", "rel_err": e, "ok": ok})
    done = [r for r in rows if r["point"].startswith("cutlass")]
    log(f"  CUTLASS: {sum(r['ok'] for r in done)}/{len(done)} correct; not built: "
        f"{ {k: v for k, v in cutlass_mods.items() if isinstance(v, str)} }")  # fmt: skip


def step_timing(results: dict, shapes, rounds: int, budget_s: float, cutlass_mods: dict) -> None:
    import torch

    log(f"step 2: timing vs torch._scaled_mm, {rounds} interleaved rounds")
    results["timing"] = {}
    for shape in shapes:
        M, N, K = shape
        flops = 2 * M * N * K
        for mode in ("blockwise", "rowwise", "tensorwise"):
            if time.monotonic() - T0 > budget_s:
                log(f"  timing budget spent: {shape} {mode} and later skipped")
                return
            A, B, sa, sb = make_problem(M, N, K, mode)
            ref = ref64(A, B, sa, sb, mode)
            fns, notes = {}, {}
            for name, f in scaled_mm_variants(A, B, sa, sb, mode).items():
                try:
                    e = rel_err(f(), ref)
                    if e < 2e-2:
                        fns["lib: " + name] = f
                        if mode == "blockwise":
                            break  # one working blockwise layout is the baseline
                    else:
                        notes[name] = f"wrong result (rel err {e:.2e})"
                except Exception as ex:  # noqa: BLE001
                    notes[name] = f"{type(ex).__name__}: {str(ex)[:200]}"
            pts = dict(BLOCK_POINTS)
            if mode != "blockwise":
                pts.update(OUTER_ONLY)
            else:
                for label, mod in cutlass_mods.items():
                    if isinstance(mod, str):
                        notes[label] = mod
                        continue
                    try:
                        e = rel_err(mod.run(A, B, sa, sb), ref)
                        if e < 1e-2:
                            fns[label] = lambda mod=mod, A=A, B=B, sa=sa, sb=sb: mod.run(A, B, sa, sb)
                        else:
                            notes[label] = f"wrong result (rel err {e:.2e})"
                    except Exception as ex:  # noqa: BLE001
                        notes[label] = f"{type(ex).__name__}: {str(ex)[:200]}"
            for label, (fam, knobs) in pts.items():
                try:
                    mod, valid = load_point(fam, knobs)
                    e = rel_err(mod.run(A, B, sa, sb), ref)
                    results.setdefault("correctness", []).append(
                        {"point": label, "shape": shape, "mode": mode, "rel_err": e, "ok": e < 1e-2}
                    )
                    if e >= 1e-2:
                        notes[label] = f"wrong result (rel err {e:.2e})"
                        continue
                    fns[label] = lambda mod=mod, A=A, B=B, sa=sa, sb=sb: mod.run(A, B, sa, sb)
                except Exception as ex:  # noqa: BLE001
                    notes[label] = f"{type(ex).__name__}: {str(ex)[:200]}"
            del ref
            torch.cuda.empty_cache()
            t = interleaved(fns, rounds)
            for v in t.values():
                if "ms" in v:
                    v["tflops"] = flops / (v["ms"] * 1e-3) / 1e12
            lib = [v["ms"] for n, v in t.items() if n.startswith("lib:") and "ms" in v]
            best_lib = min(lib) if lib else None
            ours = {n: v for n, v in t.items() if not n.startswith("lib:") and "ms" in v}
            best = min(ours, key=lambda n: ours[n]["ms"]) if ours else None
            key = f"{M}x{N}x{K} {mode}"
            results["timing"][key] = {"fns": t, "notes": notes, "best_ours": best, "best_lib_ms": best_lib}
            if best and best_lib:
                log(f"  {key}: best ours {best} {ours[best]['ms']:.4f} ms ({ours[best]['tflops']:.0f} TFLOP/s), "
                    f"best lib {best_lib:.4f} ms -> {best_lib / ours[best]['ms']:.3f}x")  # fmt: skip
            else:
                log(f"  {key}: incomplete ({notes})")
            for n, msg in notes.items():
                log(f"    note {n}: {msg}")


def step_softmax(results: dict, cutlass_mod: dict, rounds: int) -> None:
    import torch
    import torch.nn.functional as F

    from kernelarc.families import get_family
    from kernelarc.tasks.inputs import load_module

    log("step 3: softmax 4096x32768, start points vs a same-size copy")
    M, N = 4096, 32768
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    ref = torch.softmax(x.double(), dim=-1)
    nbytes = 2 * x.numel() * x.element_size()
    fns = {}
    mods = {}
    for name in ("softmax.rowblock", "softmax.online", "softmax.split_row"):
        fam = get_family(name)
        mods[name] = (load_module(fam.render(fam.start), name.replace(".", "_")), dict(fam.start))
    if "mod" in cutlass_mod:
        from kernelarc.families.cutlass_softmax import CUTLASS_SOFTMAX

        mods["softmax.cutlass_sm90"] = (cutlass_mod["mod"], dict(CUTLASS_SOFTMAX.start))
    else:
        log(f"  softmax.cutlass_sm90: not timed ({cutlass_mod.get('error', 'build not finished')})")
    for name, (mod, start) in mods.items():
        try:
            err = ((mod.run(x).double() - ref).abs() / (ref.abs() + 1e-30)).max().item()
        except Exception as ex:  # noqa: BLE001 - one kernel's failure leaves the others timed
            log(f"  {name} start: {type(ex).__name__}: {str(ex)[:200]}")
            continue
        log(f"  {name} start {start}: max rel err {err:.2e}")
        fns[name + " start"] = lambda mod=mod: mod.run(x)
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
    results["softmax"] = t


def build_cutlass_softmax(box: dict) -> None:
    """Runs in a thread from the start: the nvcc build overlaps the fp8 steps."""
    try:
        from kernelarc.cutlass import available

        if not available():
            box["error"] = "nvcc or the CUTLASS headers not found"
            return
        from kernelarc.families.cutlass_softmax import CUTLASS_SOFTMAX
        from kernelarc.tasks.inputs import load_module

        box["mod"] = load_module(CUTLASS_SOFTMAX.render(CUTLASS_SOFTMAX.start), "cutlass_softmax_start")
    except Exception as e:  # noqa: BLE001
        box["error"] = f"{type(e).__name__}: {str(e)[:300]}"


def table(results: dict) -> str:
    lines = ["", "== fp8 GEMM vs torch._scaled_mm (median of rounds; spread = (max-min)/median) =="]
    lines.append("| shape / scaling | best KernelArc point | ms | TFLOP/s | spread | best library call | ms | ratio |")
    lines.append("|---|---|---|---|---|---|---|---|")
    for key, r in results.get("timing", {}).items():
        fns = r["fns"]
        b = r["best_ours"]
        libs = {n: v for n, v in fns.items() if n.startswith("lib:") and "ms" in v}
        lb = min(libs, key=lambda n: libs[n]["ms"]) if libs else None
        ours = sorted((n for n, v in fns.items() if not n.startswith("lib:") and "ms" in v), key=lambda n: fns[n]["ms"])
        # the best point, and the best of the other kind (Triton / CUTLASS) when it is not the best
        shown = ours[:1] + [n for n in ours[1:] if n.startswith("cutlass") != ours[0].startswith("cutlass")][:1]
        li = libs[lb] if lb else None
        lib_txt = f"{lb[5:]} | {li['ms']:.4f} (spread {li['spread']:.1%})" if li else "no working call (notes) | -"
        for n in shown or [b]:
            o = fns.get(n, {})
            if "ms" not in o:
                lines.append(f"| {key} | - | - | - | - | {lib_txt} | - |")
                continue
            ratio = f"{li['ms'] / o['ms']:.3f}x" if li else "-"
            row = f"| {key} | {n} | {o['ms']:.4f} | {o['tflops']:.0f} | {o['spread']:.1%}"
            lines.append(f"{row} | {lib_txt} | {ratio} |")
    corr = results.get("correctness", [])
    if corr:
        bad = [r for r in corr if not r["ok"]]
        worst = max((r["rel_err"] for r in corr if r["ok"]), default=float("nan"))
        failed = [(r["point"], r["shape"], r["mode"]) for r in bad]
        lines.append(f"\ncorrectness: {len(corr) - len(bad)}/{len(corr)} point x shape x scaling cases within 1e-2 "
                     f"of float64 (worst {worst:.2e}); failed: {failed}")  # fmt: skip
    sm = results.get("softmax")
    if sm:
        lines.append("\n== softmax 4096x32768 (start points) ==")
        lines.append("| kernel | ms | TB/s | of same-size copy | spread |")
        lines.append("|---|---|---|---|---|")
        for n, v in sm.items():
            if "ms" in v:
                oc = f"{v['of_copy']:.0%}" if v.get("of_copy") else "-"
                lines.append(f"| {n} | {v['ms']:.4f} | {v['tbps']:.2f} | {oc} | {v['spread']:.1%} |")
            else:
                lines.append(f"| {n} | error: {v.get('error')} | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop starting new steps after this")
    args = ap.parse_args()
    out = Path(args.out) / "gpu_fp8_check"
    out.mkdir(parents=True, exist_ok=True)
    import torch
    import triton

    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    log(f"{results}")
    box: dict = {}
    builder = threading.Thread(target=build_cutlass_softmax, args=(box,), daemon=True)
    builder.start()
    fp8_box: dict = {}
    fp8_builders = [threading.Thread(target=build_cutlass_fp8, args=(label, knobs, fp8_box), daemon=True)
                    for label, knobs in CUTLASS_POINTS.items()]  # fmt: skip
    for b in fp8_builders:
        b.start()
    try:
        step_correctness(results, budget_s=args.budget_s * 0.4)
        deadline = T0 + args.budget_s * 0.45  # the nvcc builds had the correctness step's time
        for b in fp8_builders:
            b.join(timeout=max(0.0, deadline - time.monotonic()))
        cutlass_mods = {k: fp8_box.get(k, "build not finished within the budget") for k in CUTLASS_POINTS}
        step_cutlass_correctness(results, cutlass_mods)
        step_timing(results, [(8192, 8192, 8192), (4096, 4096, 4096)], args.rounds, args.budget_s * 0.8, cutlass_mods)
        # the CUTLASS build had the fp8 steps' time; wait for it only within the budget
        builder.join(timeout=max(0.0, min(45.0, args.budget_s - (time.monotonic() - T0))))
        step_softmax(results, box, rounds=3)
    except Exception:  # noqa: BLE001 - keep what was measured
        log("ERROR " + traceback.format_exc())
    tab = table(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "table.md").write_text(tab + "\n")
    (out / "log.txt").write_text("\n".join(LOG) + "\n")
    log(f"wrote {out}/results.json, table.md, log.txt")
    print(tab, flush=True)


if __name__ == "__main__":
    main()
