"""GPU benchmark: calibrate the device, run a search session per task with a fixed budget,
then time each champion side by side with the library baselines in one process.

Usage (on the GPU machine, repo root, wheels from scripts/build_wheels.sh installed):
  python scripts/bench.py --tasks rmsnorm,softmax,matmul --candidates 30 --minutes 2.5 --out $OUT
Prints one table per task last; writes bench.json and bench.md under --out.
A sweep instead of a search (every feasible point of a grid, judged the same way):
  python scripts/bench.py --tasks matmul --candidates 200 --minutes 8 --set agents.backend=sweep \
      --set agents.sweep.family=matmul.cutlass_sm90 --set 'agents.sweep.grid={CLUSTER_M:[1,2]}' --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Workloads per task for the bench (indices into the task's GPU workload list).
DEFAULT_WORKLOADS = {
    "matmul": [0, 1, 2, 3],
    "fp8_matmul": [0, 1],  # 8192^3, 4096^3
    "attention": [0, 1],
    "attention_residual": [0, 1],  # non-causal and causal
    "rmsnorm": [0, 1],
    "fused_add_rmsnorm": [0],
    "softmax": [0, 1],
    "swiglu": [0],
    "rope": [0],
}


def _corrected_ratio(lat: dict, ref_lat: dict, cand_id: str, wi: int) -> float | None:
    """The reference's drift-corrected latency over a candidate's on workload ``wi`` (None if either is missing)."""
    b, c = ref_lat.get(wi), lat.get(cand_id, {}).get(wi)
    return b / c if b and c else None


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def compose(overrides: list[str]):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from kernelarc.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base=None):
        return hcompose(config_name="config", overrides=overrides)


def library_compare(task_name: str, champion_src: str, wl_axes: dict) -> dict:
    """Champion vs library calls, interleaved in this process with triton's do_bench (medians)."""
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from kernelarc.tasks.inputs import load_module

    mod = load_module(champion_src, "champion")
    out: dict = {}
    dev = "cuda"
    if task_name in ("attention", "attention_residual"):
        B, H, Hkv, S, D = (wl_axes[k] for k in ("B", "H", "Hkv", "S", "D"))
        q = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
        k = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        v = torch.randn(B, Hkv, S, D, device=dev, dtype=torch.bfloat16)
        res = torch.randn(B, H, S, D, device=dev, dtype=torch.bfloat16)
        causal = int(wl_axes.get("causal", 0))
        from torch.nn.attention import SDPBackend, sdpa_kernel

        args = (q, k, v, res, causal) if task_name == "attention_residual" else (q, k, v, causal)
        fns = {"champion": lambda: mod.run(*args)}
        for name, be in (("cudnn_sdpa", SDPBackend.CUDNN_ATTENTION), ("flash_sdpa", SDPBackend.FLASH_ATTENTION)):

            def f(be=be):
                with sdpa_kernel([be]):
                    o = F.scaled_dot_product_attention(q, k, v, is_causal=bool(causal), enable_gqa=Hkv != H)
                return o + res if task_name == "attention_residual" else o

            fns[name] = f
        flops = 4 * B * H * S * S * D * (0.5 if causal else 1.0)
    elif task_name == "matmul":
        M, N, K = (wl_axes[k] for k in ("M", "N", "K"))
        a = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        b = torch.randn(N, K, device=dev, dtype=torch.bfloat16)
        fns = {"champion": lambda: mod.run(a, b), "cublas_matmul": lambda: torch.matmul(a, b.T),
               "cublas_linear": lambda: F.linear(a, b)}  # fmt: skip
        flops = 2 * M * N * K
    elif task_name == "fp8_matmul":
        from kernelarc.tasks.loader import load_builtin

        M, N, K = (wl_axes[k] for k in ("M", "N", "K"))
        ref_mod = load_module(load_builtin("fp8_matmul").definition.reference, "fp8_matmul_reference")
        a, b, sa, sb = ref_mod.get_inputs(dict(wl_axes), torch.device(dev)).values()
        expected = ref_mod.run(a, b, sa, sb).float()
        # torch._scaled_mm with the same blockwise scaling (1x128 / 128x128), in the layouts torch accepts;
        # the first one that runs and matches the reference is the library baseline
        sa_mmajor = sa.t().contiguous().t()
        variants = {
            "scaled_mm_blockwise": lambda: torch._scaled_mm(a, b.t(), scale_a=sa_mmajor, scale_b=sb.t(),
                                                            out_dtype=torch.bfloat16),
            "scaled_mm_blockwise_sbc": lambda: torch._scaled_mm(a, b.t(), scale_a=sa_mmajor,
                                                                scale_b=sb.t().contiguous(), out_dtype=torch.bfloat16),
        }  # fmt: skip
        if hasattr(F, "scaled_mm"):  # the v2 API: B's scales [round_up(K/128, 4), N/128], stride (1, that)
            kb4 = -(-sb.shape[1] // 4) * 4
            sb4 = torch.zeros(sb.shape[0], kb4, device=sb.device, dtype=torch.float32)
            sb4[:, : sb.shape[1]] = sb
            st = F.ScalingType
            variants["F.scaled_mm_blockwise"] = lambda: F.scaled_mm(
                a, b.t(), sa_mmajor, st.BlockWise1x128, sb4.t(), st.BlockWise128x128, output_dtype=torch.bfloat16
            )
        fns = {"champion": lambda: mod.run(a, b, sa, sb)}
        for name, f in variants.items():
            try:
                y = f().float()
                if ((y - expected).norm() / expected.norm()).item() < 2e-2:
                    fns[name] = f
                    break
                out[name + "_error"] = "result differs from the reference"
            except Exception as e:  # noqa: BLE001
                out[name + "_error"] = str(e)[:200]
        flops = 2 * M * N * K
    else:
        return out
    # Interleaved rounds, the order reversed every other round (a GEMM near the power limit runs
    # slower as the card heats, which would otherwise favour whoever goes first); the spread of a
    # function's rounds says how far to trust a ratio.
    rounds = 5  # attention had 2 until 2026-11-30 10:40; its figures moved ±3% between calls
    for rnd in range(rounds):
        for name, f in list(fns.items())[:: -1 if rnd % 2 else 1]:
            try:
                ms = do_bench(f, warmup=25, rep=100, return_mode="median")
                out.setdefault(name, []).append(ms)
            except Exception as e:  # noqa: BLE001
                out[name + "_error"] = str(e)[:200]
    res_: dict = {k: (min(v) if isinstance(v, list) else v) for k, v in out.items()}
    res_["rounds_ms"] = {k: v for k, v in out.items() if isinstance(v, list)}
    res_["tflops"] = {k: flops / (v * 1e-3) / 1e12 for k, v in res_.items() if isinstance(v, float)}
    return res_


def same_size_copy(nbytes: float) -> dict:
    """A device-to-device copy moving the same bytes (read + written) as one workload, timed like the
    libraries above (do_bench median, L2 flushed between calls): the bandwidth a memory-bound kernel
    of this size can reach, next to the large-buffer calibration figure."""
    import torch
    from triton.testing import do_bench

    n = max(int(nbytes // 4), 1)  # bf16 elements: n read + n written = nbytes
    src = torch.randn(n, device="cuda", dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    ms = min(do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median") for _ in range(2))
    return {"copy_ms": ms, "copy_tbps": 4 * n / (ms * 1e-3) / 1e12}


def seeds_summary(tasks: dict) -> list[str]:
    """Per task and workload, each seed's champion: latency, fraction of a same-size copy (memory-bound
    workloads, measured on the GPU only) and how many seeds reach 90% of it; candidates and where the
    champion was found, so the budget behind each figure is on the same line."""
    lines = ["", "## seeds: each seed's champion"]
    by_task: dict[str, list[tuple[str, dict]]] = {}
    for key, s in tasks.items():
        if "@seed=" in key:
            by_task.setdefault(key.split("@seed=")[0], []).append((key.split("@seed=")[1], s))
    for task, runs in by_task.items():
        lines.append(f"### {task}")
        lines.append("| seed | workload | axes | champion | ms | TB/s | of same-size copy | candidates | found at |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        reached: dict[int, list[bool]] = {}
        for seed, s in runs:
            if "error" in s:
                lines.append(f"| {seed} | - | - | error: {s['error'][:120]} | | | | | |")
                continue
            for w in s.get("workloads", []):
                frac = w["tbps"] / w["copy_tbps"] if w.get("tbps") and w.get("copy_tbps") else None
                if frac is not None:
                    reached.setdefault(w["index"], []).append(frac >= 0.9)
                lines.append(f"| {seed} | {w['index']} | {w['axes']} | {s['champion_family']} | "
                             f"{w['latency_ms'] or 0:.4f} | {w['tbps'] or 0:.2f} | "
                             f"{'-' if frac is None else f'{frac:.1%}'} | {s['evaluated']} | "
                             f"{s.get('champion_found_at')} |")  # fmt: skip
        for wi, ok in sorted(reached.items()):
            lines.append(f"workload {wi}: {sum(ok)} of {len(runs)} seeds at >= 90% of a same-size copy")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default="rmsnorm,softmax,matmul")
    ap.add_argument("--candidates", type=int, default=30)
    ap.add_argument("--minutes", type=float, default=2.5)
    ap.add_argument("--agents", type=int, default=4)
    # guard workers per GPU: compiles (nvcc for CUTLASS: 40-60 s each) overlap, timing stays serial;
    # 8 on the 16-core H200 host ran 9-13 matmul candidates/min with about half of them CUTLASS builds
    ap.add_argument("--parallel", type=int, default=min(8, max(2, (os.cpu_count() or 4) // 2)))
    ap.add_argument("--deadline-min", type=float, default=9.0, help="stop starting new tasks after this")
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--state", default="/tmp/kernelarc-bench", help="session state and MLflow store")
    ap.add_argument("--no-compile-baseline", action="store_true")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="config override for every session (repeatable), e.g. agents.backend=sweep "
                    "agents.sweep.family=matmul.cutlass_sm90 'agents.sweep.grid={TILE_N:[128,256]}'")  # fmt: skip
    ap.add_argument("--compare-agents", default="", help="e.g. 1,4: equal-budget sessions per agent count instead")
    ap.add_argument(
        "--seeds",
        default="",
        help="e.g. 0,1,2: one session per seed (config key seed), one after the other, each with its own state "
        "and MLflow store: no seed starts from another's champion",
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    Path(args.state).mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    import torch

    from kernelarc.hardware import calibrate, resolve_target

    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tasks": {}}
    target = resolve_target("auto")
    on_gpu = torch.cuda.is_available()
    dev_name = torch.cuda.get_device_name(0) if on_gpu else "cpu"
    log(f"device {dev_name} -> target {target.name}; calibrating ...")
    cal = calibrate(target, "cuda:0" if on_gpu else "cpu")
    results["calibration"] = cal
    log(f"calibration: {json.dumps({k: v for k, v in cal.items() if isinstance(v, int | float)})}")
    (out / "bench.json").write_text(json.dumps(results, indent=2, default=str))

    from kernelarc import dispatch
    from kernelarc.app import typed
    from kernelarc.config import plain
    from kernelarc.ui import Progress
    from kernelarc.wiring import build_session

    runs = [(t, None) for t in args.tasks.split(",")]
    if args.compare_agents:
        runs = [(t, int(n)) for t in args.tasks.split(",") for n in args.compare_agents.split(",")]
    seeds = [int(x) for x in args.seeds.split(",") if x.strip()] or [None]
    for (task_name, n_agents), seed in ((r, sd) for r in runs for sd in seeds):
        if (time.monotonic() - t_start) / 60 > args.deadline_min:
            log(f"deadline reached; skipping {task_name}")
            continue
        key = task_name if n_agents is None else f"{task_name}@agents={n_agents}"
        state = args.state if n_agents is None else f"{args.state}/agents{n_agents}"
        if seed is not None:  # own state and registry: independent searches
            key, state = f"{key}@seed={seed}", f"{state}/seed{seed}"
        wls = DEFAULT_WORKLOADS.get(task_name)
        overrides = [
            f"+task={task_name}", f"gpu={target.name}", f"budget.candidates={args.candidates}",
            f"budget.minutes={args.minutes}", f"agents.count={n_agents or args.agents}", "agents.backend=search",
            f"executor.parallel={args.parallel}", "executor.prestart=3", f"search.state_dir={state}/state",
            f"tracking.uri=sqlite:///{state}/mlflow.db", f"task.workloads=[{','.join(map(str, wls))}]" if on_gpu else "task.workloads=null",  # noqa: E501
            f"guard.compile_baseline={'false' if args.no_compile_baseline else 'true'}",
        ] + ([f"seed={seed}"] if seed is not None else [])  # fmt: skip
        for extra in args.set:  # a --set replaces the default for its key
            name = extra.split("=", 1)[0].lstrip("+")
            overrides = [o for o in overrides if o.split("=", 1)[0].lstrip("+") != name] + [extra]
        Path(state).mkdir(parents=True, exist_ok=True)
        log(f"search session: {key} ({' '.join(overrides)})")
        try:
            cfg = compose(overrides)
            c = typed(cfg)
            c.gpu = target  # calibrated ceilings
            session = build_session(c, plain(cfg), target, progress=Progress(True))
            task = session.task
            summary = session.run()
            champ_rec = next((r for r in reversed(session.records) if r.candidate.id == summary["champion"]), None)
            per_wl = []
            if session.champion_verdict:
                for w in session.champion_verdict.workloads:
                    per_wl.append({k: getattr(w, k) for k in ("index", "axes", "latency_ms", "tflops", "tbps",
                                   "sol_fraction", "sol_bound", "baseline_ms", "compile_ms", "speedup_vs_baseline",
                                   "speedup_vs_compile")})  # fmt: skip
            summary["workloads"] = per_wl
            # The guard's ratios divide the champion's latency by the reference's timed at session start;
            # a GPU that drifts (clocks under load) skews them. Chained interleaved ratios do not drift.
            lat = session.drift_corrected_latencies()
            ref_rec = next((r for r in session.records if r.kind == "baseline" and r.candidate.strategy == "reference"),
                           None)  # fmt: skip
            ref_lat = lat.get(ref_rec.candidate.id, {}) if ref_rec else {}
            for w in per_wl:
                w["vs_reference_corrected"] = _corrected_ratio(lat, ref_lat, summary["champion"], w["index"])
            if on_gpu:
                for w in per_wl:
                    if w["sol_bound"] == "memory" and w["tbps"] and w["latency_ms"]:
                        w.update(same_size_copy(w["tbps"] * 1e12 * w["latency_ms"] * 1e-3))
            if on_gpu and champ_rec is not None and task_name.startswith("attention"):
                summary["library"] = {}
                for wi in wls:
                    axes = dict(task.axes(wi))
                    axes["causal"] = task.workloads[wi].inputs["causal"].value
                    label = f"workload {wi} ({'causal' if axes['causal'] else 'non-causal'})"
                    summary["library"][label] = library_compare(task_name, champ_rec.candidate.source, axes)
            if on_gpu and champ_rec is not None and task_name in ("matmul", "fp8_matmul"):
                src = champ_rec.candidate.source
                summary["library"] = {f"workload {wi} {task.axes(wi)}": library_compare(task_name, src, task.axes(wi))
                                      for wi in wls}  # fmt: skip
            if champ_rec is not None and champ_rec.candidate.family == dispatch.FAMILY:
                fam_of = {r.candidate.id: r.candidate for r in session.records}
                summary["dispatch_parts"] = {
                    k: f"{fam_of[v].family} {json.dumps(fam_of[v].knobs)}" if v in fam_of else v
                    for k, v in champ_rec.candidate.knobs.items()
                }
            if champ_rec is not None:
                (out / f"champion_{key.replace('@', '_').replace('=', '')}.py").write_text(champ_rec.candidate.source)
            cands = [r for r in session.records if r.kind == "candidate"]
            # every candidate with its full knobs and verdict, for analysis after the run
            with (out / f"candidates_{key.replace('@', '_').replace('=', '')}.jsonl").open("w") as fh:
                for r in cands:
                    v = r.verdict
                    fh.write(json.dumps({"index": r.index + 1, "agent": r.candidate.agent, "family": r.candidate.family,
                                         "knobs": r.candidate.knobs, "status": v.status.value, "latency_ms": v.latency_ms,  # noqa: E501
                                         "speedup_vs_champion": v.speedup_vs_champion,
                                         "per_workload_ms": [w.latency_ms for w in v.workloads],
                                         "rationale": r.candidate.rationale}, default=str) + "\n")  # fmt: skip
            # the fastest correct candidates (by their latency in their own run), whether or not they won
            top = sorted(
                (r for r in cands if r.verdict.correct and r.verdict.latency_ms), key=lambda r: r.verdict.latency_ms
            )
            summary["top"] = [
                {"index": r.index + 1, "family": r.candidate.family, "knobs": r.candidate.knobs,
                 "latency_ms": r.verdict.latency_ms, "vs_reference": r.verdict.speedup_vs_baseline or 0.0,
                 "per_workload_vs_reference": [w.speedup_vs_baseline for w in r.verdict.workloads],
                 "per_workload_vs_reference_corrected": [
                     _corrected_ratio(lat, ref_lat, r.candidate.id, w.index) for w in r.verdict.workloads]}
                for r in top[:5]
            ]  # fmt: skip
            best_at = next((r.index + 1 for r in reversed(cands) if r.candidate.id == summary["champion"]), 0)
            summary["champion_found_at"] = best_at
            results["tasks"][key] = summary
        except Exception as e:  # noqa: BLE001 - one task's failure must not lose the others
            traceback.print_exc()
            results["tasks"][key] = {"error": f"{type(e).__name__}: {e}"}
        (out / "bench.json").write_text(json.dumps(results, indent=2, default=str))

    lines = [f"# KernelArc bench {results['date']} on {dev_name}", ""]
    cal_s = ", ".join(f"{k}={v:.4g}" for k, v in cal.items() if isinstance(v, int | float))
    lines.append(f"calibration: {cal_s}")
    for name, s in results["tasks"].items():
        lines += ["", f"## {name}"]
        if "error" in s:
            lines.append(f"error: {s['error']}")
            continue
        lines.append(f"champion {s['champion_family']} by {s['champion_agent']}; {s['evaluated']} candidates "
                     f"{json.dumps(s['by_status'])}; {s['candidates_per_min']:.1f} candidates/min; "
                     f"GPU timing {s['gpu_timing_min']:.2f} min of {s['elapsed_min']:.2f} min; plateau events {s['plateau_events']}")  # fmt: skip  # noqa: E501
        lines.append(
            f"champion found at candidate {s.get('champion_found_at')} (0 = a baseline or the registry champion)"
        )
        lines.append(
            "| workload | axes | reference ms | torch.compile ms | champion ms | TFLOP/s | TB/s | SOL frac | bound "
            "| vs reference | vs reference, drift-corrected | vs torch.compile | same-size copy TB/s |"
        )
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for w in s.get("workloads", []):

            def f(x, p=3):
                return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{p}f}"

            lines.append(f"| {w['index']} | {w['axes']} | {f(w['baseline_ms'], 4)} | {f(w['compile_ms'], 4)} | {f(w['latency_ms'], 4)} | {f(w['tflops'], 1)} | {f(w['tbps'], 2)} | "  # noqa: E501
                         f"{f(w['sol_fraction'], 2)} | {w['sol_bound']} | {f(w['speedup_vs_baseline'], 2)}x | {f(w.get('vs_reference_corrected'), 2)}x | {f(w['speedup_vs_compile'], 2)}x | {f(w.get('copy_tbps'), 2)} |")  # fmt: skip  # noqa: E501
        for t in s.get("top", [])[:3]:
            per = ", ".join(f"{x:.2f}x" for x in t["per_workload_vs_reference"] if x)
            cor = ", ".join(f"{x:.2f}x" for x in t.get("per_workload_vs_reference_corrected") or [] if x)
            lines.append(f"fastest correct #{t['index']}: {t['family']} {t['latency_ms']:.4f} ms geomean, "
                         f"{t['vs_reference']:.2f}x reference (per workload {per}; drift-corrected {cor or '-'}) "
                         f"{json.dumps(t['knobs'])}")  # fmt: skip
        for k, part in (s.get("dispatch_parts") or {}).items():
            lines.append(f"dispatch {k}: {part}")
        for label, lib in (s.get("library") or {}).items():
            ms = {k: v for k, v in lib.items() if isinstance(v, float)}
            if "champion" in ms:
                ratios = ", ".join(f"{ms[k] / ms['champion']:.2f}x vs {k}" for k in ms if k != "champion")
                rounds_ms = lib.get("rounds_ms") or {}
                spread = {k: f"{(max(v) - min(v)) / min(v):.1%}" for k, v in rounds_ms.items()}
                n_rounds = len(next(iter(rounds_ms.values()), []))
                lines.append(f"library side by side, {label} "
                             f"(do_bench medians, best of {n_rounds} interleaved rounds, ms): "
                             f"{json.dumps({k: round(v, 4) for k, v in ms.items()})}; champion {ratios}; "
                             f"round-to-round spread {json.dumps(spread)}")  # fmt: skip
            errs = {k: v for k, v in lib.items() if k.endswith("_error")}
            if errs:
                lines.append(f"library errors, {label}: {json.dumps(errs)}")
    if len(seeds) > 1:
        lines += seeds_summary(results["tasks"])
    md = "\n".join(lines)
    (out / "bench.md").write_text(md)
    print(md, flush=True)


if __name__ == "__main__":
    main()
