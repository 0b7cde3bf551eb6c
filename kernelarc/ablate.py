"""``python -m kernelarc.ablate``: does the team beat one agent, and what does memory buy?

Every run is a real :class:`kernelarc.session.SearchSession` (Hydra config, agents, board, plateau
breaker, dedupe, rematches, champion rule) built from the same config as the product; arms differ
only in config: ``agents.count`` x ``memory.limit`` x plateau on/off, over seeds. The guard is the
simulated one (:mod:`kernelarc.simguard`, a deterministic cost model) by default, or the real one
(``ablate.guard=real``, on a GPU).

Budgets: ``ablate.mode=candidates`` gives every arm the same number of candidates; every arm keeps the
same evaluations in flight, since the session itself sizes proposals to the free evaluation slots
(:mod:`kernelarc.allot`: a lone agent proposes for every free slot, a team shares them), so no arm
proposes blind to verdicts it could have waited for; ``ablate.mode=wallclock`` the same minutes (the
simulated guard then takes ``ablate.eval_s`` seconds per evaluation).

Per arm: mean, median and spread (standard deviation, min, max) of the final champion's latency
over the best known (the model's optimum on the simulated guard, the best latency any run reached
on the real one), runs within 1% and 5% of it, and a one-sided permutation test of the arm's mean
against the single generalist's (agents.count=1, same memory and plateau setting). Plots: the
best-so-far curve per arm and the memory curve (0/4/16/unlimited), written as PNG next to
``results.json`` and ``table.md`` and logged to MLflow when ``ablate.mlflow=true``.

Arguments are ``ablate.KEY=VALUE`` (see :class:`AblateConfig`) and any session override, e.g.
``python -m kernelarc.ablate +task=matmul ablate.seeds=16 ablate.budget=96 agents.per_round=2``.
"""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

log = logging.getLogger(__name__)
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class AblateConfig:
    counts: list[int] = field(default_factory=lambda: [1, 4])
    memory: list[Any] = field(default_factory=lambda: [0, 4, 16, None])  # None: unlimited
    plateau: list[bool] = field(default_factory=lambda: [True, False])
    seeds: int = 32
    seed0: int = 0
    budget: int = 64  # candidates per run (mode=candidates); at 96 both arms reach the GEMM optimum most runs
    mode: str = "candidates"  # candidates | wallclock
    minutes: float = 0.5  # per run (mode=wallclock)
    eval_s: float = 0.05  # simulated seconds per evaluation (mode=wallclock)
    guard: str = "sim"  # sim | real
    model_seed: int = 0  # the simulated cost model's seed
    library_gap: float = 1.30  # the simulated library's latency over the families' optimum
    patience: int = 10  # plateau patience when the plateau is on
    jobs: int = 2  # runs in parallel (processes, all tasks' runs in one pool); guard=real: GPUs dealt round robin
    # mode=candidates: a wall-clock cap per run (budget.minutes) on top of the candidate budget, so that an
    # ablation on the real guard ends in time; a run it cuts has fewer candidates (the table's cands column)
    max_minutes: float | None = None
    # no new runs: the tables, results.json and plots from the runs.jsonl already in out (or out/<task>), e.g.
    # of an ablation that a time limit cut before its report
    report_only: bool = False
    out: str = "ablation"
    tasks: list[str] = field(default_factory=list)  # several tasks in one command: one sub-folder of out each
    mlflow: bool = False
    tracking_uri: str | None = None


@dataclass
class RunResult:
    count: int
    memory: int | None
    plateau: bool
    seed: int
    ratio: float  # final champion latency / best known (the model's optimum on the simulated guard)
    latency_ms: float
    curve: list[float]  # champion latency after each evaluated candidate (true latency on the sim)
    evaluated: int
    plateau_events: int
    seconds: float
    best_ms: float  # the best known latency the ratio is over (the model's optimum; on a GPU, set afterwards)
    found: float  # the fastest correct family candidate evaluated, over best_ms (the champion may be slower)


def arm_key(count: int, memory: int | None, plateau: bool) -> str:
    return f"agents={count} memory={'all' if memory is None else memory} plateau={'on' if plateau else 'off'}"


def _compose(overrides: list[str]):
    from hydra import compose, initialize_config_dir

    from kernelarc.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=overrides)


def build_run(ab: AblateConfig, session_overrides: list[str], count: int, memory: int | None, plateau: bool,
              seed: int, gpu: int | None = None) -> tuple[Any, str]:  # fmt: skip
    """The search session of one arm and seed, not started, and its fresh state folder (remove it after)."""
    from kernelarc.app import resolve_gpu, typed
    from kernelarc.config import plain
    from kernelarc.simguard import simulated_guard_factory
    from kernelarc.ui import Progress
    from kernelarc.wiring import build_session

    state = tempfile.mkdtemp(prefix="kernelarc-ablate-")
    sim = ab.guard == "sim"
    over = [
        "agents.backend=search", f"agents.count={count}", f"memory.limit={'null' if memory is None else memory}",
        f"search.plateau_patience={ab.patience if plateau else 10**9}", f"seed={seed}", f"search.state_dir={state}",
        "tracking.enabled=false", "search.progress=false",
    ]  # fmt: skip
    if ab.mode == "wallclock":
        over += [f"budget.candidates={10**6}", f"budget.minutes={ab.minutes}"]
    else:
        over += [f"budget.candidates={ab.budget}", f"budget.minutes={ab.max_minutes or 1000000}"]
    if sim:
        # a simulated torch.compile costs no time, so it is measured before the search, as the recorded
        # simulated ablations were (beside the search it would only take the first round's slot)
        over += ["gpu=cpu", "search.calibrate=false", "search.compile_beside_search=false"]
    else:
        # both arms alike: no calibration, no torch.compile baseline (minutes of compile on some tasks)
        over += ["search.calibrate=false", "guard.compile_baseline=false"]
        over += [f"executor.gpus=[{gpu}]"] if gpu is not None else []
    cfg = _compose(session_overrides + over)
    c = typed(cfg)
    target = resolve_gpu(c)
    delay = ab.eval_s if ab.mode == "wallclock" else 0.0
    make = simulated_guard_factory(ab.model_seed, ab.library_gap, delay_s=delay) if sim else None
    # every arm is built by the same wiring from its config; only the guard may be the simulated one
    return build_session(c, plain(cfg), target, progress=Progress(False), make_guard=make), state


def run_one(ab: AblateConfig, session_overrides: list[str], count: int, memory: int | None, plateau: bool,
            seed: int, gpu: int | None = None, sessions: list | None = None) -> RunResult:  # fmt: skip
    """One search session of one arm and seed (in its own fresh state folder); ``sessions``, when given,
    receives the finished session (its records, board and agents, for a closer look)."""
    session, state = build_run(ab, session_overrides, count, memory, plateau, seed, gpu)
    sim = ab.guard == "sim"
    t = time.monotonic()
    summary = session.run()
    dt = time.monotonic() - t
    if sessions is not None:
        sessions.append(session)
    model = session.guards[0].model if sim else None

    def true_ms(cand) -> float:
        if model is None:
            return math.nan
        lat = model.point_latency(cand.family, cand.knobs) if cand.family in model.families else model.library_ms()
        return lat if isinstance(lat, float) else math.nan

    curve: list[float] = []
    champ_ms = math.nan
    found = math.inf
    for r in session.records:
        if r.kind == "candidate" and r.verdict.correct and r.candidate.family:
            found = min(found, true_ms(r.candidate) if sim else (r.verdict.latency_ms or math.inf))
        if r.verdict.status.value == "champion" and r.kind in ("baseline", "candidate"):
            champ_ms = true_ms(r.candidate) if sim else (r.verdict.latency_ms or math.nan)
        if r.kind == "candidate":
            curve.append(champ_ms)
    final = curve[-1] if curve else champ_ms
    best = model.optimum() if model is not None else math.nan
    # the run's state folder has served its purpose (its numbers are in the result); a failed run keeps
    # its folder for a look (thousands of runs left thousands of folders in /tmp otherwise)
    shutil.rmtree(state, ignore_errors=True)
    return RunResult(count, memory, plateau, seed, final / best if sim else math.nan, final, curve,
                     summary["evaluated"], summary["plateau_events"], dt, best,
                     found / best if sim else found)  # fmt: skip


def permutation_p(a: Sequence[float], b: Sequence[float], rounds: int = 10000, seed: int = 0) -> float:
    """One-sided p-value that ``a``'s mean is lower (better) than ``b``'s by chance alone."""
    a, b = [x for x in a if math.isfinite(x)], [x for x in b if math.isfinite(x)]
    if not a or not b:
        return math.nan
    obs = statistics.fmean(b) - statistics.fmean(a)
    pooled = a + b
    rng = random.Random(seed)
    hits = 0
    for _ in range(rounds):
        rng.shuffle(pooled)
        if statistics.fmean(pooled[len(a) :]) - statistics.fmean(pooled[: len(a)]) >= obs - 1e-12:
            hits += 1
    return (hits + 1) / (rounds + 1)


def paired_p(diffs: Sequence[float], rounds: int = 10000, seed: int = 0) -> float:
    """One-sided sign-flip p-value that the mean of the paired ``diffs`` is above 0 by chance alone."""
    d = [x for x in diffs if math.isfinite(x)]
    if not d:
        return math.nan
    obs = sum(d)
    rng = random.Random(seed)
    hits = sum(sum(x if rng.random() < 0.5 else -x for x in d) >= obs - 1e-12 for _ in range(rounds))
    return (hits + 1) / (rounds + 1)


def memory_steps(results: list[RunResult]) -> list[dict[str, Any]]:
    """The memory curve as paired steps: per agent count and plateau setting, each memory.limit against
    the next larger one on the same seeds. ``diff``: mean ratio with more memory minus with less (below 0:
    more memory is better); ``p_worse``: one-sided sign-flip p that more memory is worse by chance alone."""
    runs: dict[tuple, dict[int, float]] = {}
    for r in results:
        runs.setdefault((r.count, r.plateau, r.memory), {})[r.seed] = r.ratio
    out = []
    for count, plateau in sorted({(k[0], k[1]) for k in runs}, key=lambda k: (k[0], not k[1])):
        mems = sorted({k[2] for k in runs if k[:2] == (count, plateau)}, key=_mem_order)
        for less, more in zip(mems, mems[1:], strict=False):
            a, b = runs[(count, plateau, less)], runs[(count, plateau, more)]
            d = [b[s] - a[s] for s in sorted(a) if s in b and math.isfinite(a[s]) and math.isfinite(b[s])]
            out.append({"agents": count, "plateau": plateau, "from": less, "to": more, "seeds": len(d),
                        "diff": statistics.fmean(d) if d else math.nan, "p_worse": paired_p(d),
                        "p_better": paired_p([-x for x in d])})  # fmt: skip
    return out


def steps_table(steps: list[dict[str, Any]]) -> str:
    mem = lambda m: "all" if m is None else str(m)  # noqa: E731
    lines = ["| agents | plateau | memory | seeds | mean diff (more - less) | p more is worse | p more is better |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for s in steps:
        lines.append(f"| {s['agents']} | {'on' if s['plateau'] else 'off'} | {mem(s['from'])} -> {mem(s['to'])} | "
                     f"{s['seeds']} | {s['diff']:+.4f} | {s['p_worse']:.3f} | {s['p_better']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def summarize(results: list[RunResult]) -> list[dict[str, Any]]:
    """One row per arm (ratios: final champion latency over the best known)."""
    arms: dict[tuple, list[RunResult]] = {}
    for r in results:
        arms.setdefault((r.count, r.memory, r.plateau), []).append(r)

    def ratios(rs: list[RunResult]) -> list[float]:
        return [r.ratio for r in rs]

    rows = []
    for (count, memory, plateau), rs in sorted(
        arms.items(), key=lambda kv: (kv[0][0], _mem_order(kv[0][1]), not kv[0][2])
    ):
        xs = ratios(rs)
        ref = arms.get((1, memory, plateau))
        p = permutation_p(xs, ratios(ref)) if ref is not None and count != 1 else math.nan
        fin = [x for x in xs if math.isfinite(x)]
        rows.append({
            "arm": arm_key(count, memory, plateau), "agents": count, "memory": memory, "plateau": plateau,
            "runs": len(rs), "mean": statistics.fmean(fin) if fin else math.nan,
            "median": statistics.median(fin) if fin else math.nan,
            "std": statistics.pstdev(fin) if len(fin) > 1 else 0.0, "min": min(fin, default=math.nan),
            "max": max(fin, default=math.nan), "within_1pct": sum(x <= 1.01 for x in fin),
            "within_5pct": sum(x <= 1.05 for x in fin), "p_vs_generalist": p,
            "found_mean": statistics.fmean(f) if (f := [r.found for r in rs if math.isfinite(r.found)]) else math.nan,
            "evaluated": statistics.fmean(r.evaluated for r in rs),
            "plateau_events": statistics.fmean(r.plateau_events for r in rs),
        })  # fmt: skip
    return rows


def _mem_order(m: int | None) -> float:
    return math.inf if m is None else float(m)


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| arm | runs | mean | median | std | min | max | <=1% | <=5% | p vs 1 agent | best found | cands | plateaus |"
    )
    lines = [head, "|" + "---|" * 13]
    for r in rows:
        p = "-" if math.isnan(r["p_vs_generalist"]) else f"{r['p_vs_generalist']:.3f}"
        lines.append(
            f"| {r['arm']} | {r['runs']} | {r['mean']:.4f} | {r['median']:.4f} | {r['std']:.4f} | {r['min']:.4f} | "
            f"{r['max']:.4f} | {r['within_1pct']} | {r['within_5pct']} | {p} | {r['found_mean']:.4f} | "
            f"{r['evaluated']:.0f} | "
            f"{r['plateau_events']:.1f} |"
        )
    return "\n".join(lines)


def share_device_memory(overrides: list[str], total_gb: float, sessions_per_gpu: int) -> list[str]:
    """Concurrent real-guard sessions on one GPU each plan their inputs, copies and workers for the whole
    card unless told otherwise (on the H200, ten rmsnorm sessions ran out of memory at start-up): give each
    an equal share, 80% of the card split evenly, unless ``guard.memory_gb`` is set already."""
    if sessions_per_gpu <= 1 or any(o.lstrip("+").startswith("guard.memory_gb=") for o in overrides):
        return overrides
    return [*overrides, f"guard.memory_gb={max(1, int(0.8 * total_gb / sessions_per_gpu))}"]


def _job(args: tuple) -> RunResult | dict[str, Any]:
    """One run; a run that fails (a session error, a guard that cannot start) is returned as its arm,
    seed and error, so one broken run costs its own row, not the whole ablation."""
    ab, over, count, memory, plateau, seed, gpu = args
    try:
        return run_one(ab, over, count, memory, plateau, seed, gpu)
    except Exception as e:  # noqa: BLE001 - reported in results.json and the table's note
        log.error("ablation run %s seed %d failed: %s", arm_key(count, memory, plateau), seed, e)
        return {"arm": arm_key(count, memory, plateau), "seed": seed, "error": f"{type(e).__name__}: {e}"[:500]}


def _prepare(ab: AblateConfig, session_overrides: list[str]) -> tuple[list[str], int | None]:
    """The checked session overrides of one task (matmul unless given) and the GPUs the runs share."""
    if ab.mode not in ("candidates", "wallclock"):
        raise ValueError(f"ablate.mode must be candidates or wallclock, not {ab.mode!r}")
    if ab.guard not in ("sim", "real"):
        raise ValueError(f"ablate.guard must be sim or real, not {ab.guard!r}")
    if ab.max_minutes is not None and ab.max_minutes <= 0:
        raise ValueError(f"ablate.max_minutes must be positive, not {ab.max_minutes}")
    if not any(o.lstrip("+").startswith("task=") for o in session_overrides):
        session_overrides = ["+task=matmul", *session_overrides]
    gpus = None
    if ab.guard == "real":
        import torch

        if torch.cuda.is_available():
            gpus = torch.cuda.device_count()
            total_gb = torch.cuda.get_device_properties(0).total_memory / 2**30
            session_overrides = share_device_memory(session_overrides, total_gb, math.ceil(ab.jobs / max(gpus, 1)))
        else:  # the real guard on the CPU (Triton interpreter, tiny workloads): slow, for checking the path
            log.warning("ablate.guard=real without a CUDA GPU: sessions run on the CPU")
    return session_overrides, gpus


def _jobs(ab: AblateConfig, session_overrides: list[str], gpus: int | None, first: int = 0) -> list[tuple]:
    """Every run of one task, seed by seed (so that a cut ablation leaves its arms balanced); ``first``: the
    runs queued before these (GPUs are dealt round robin over all of them)."""
    jobs = []
    for seed in range(ab.seed0, ab.seed0 + ab.seeds):
        for count in ab.counts:
            for memory in ab.memory:
                for plateau in ab.plateau:
                    gpu = (first + len(jobs)) % max(1, min(ab.jobs, gpus)) if gpus else None
                    jobs.append((ab, session_overrides, count, memory, plateau, seed, gpu))
    return jobs


def _run_jobs(jobs: list[tuple], n: int, outs: list[Path]) -> list[RunResult | dict[str, Any]]:
    """All runs, ``n`` at a time; each one's result is appended to ``runs.jsonl`` in its task's folder
    (``outs[i]`` for ``jobs[i]``) as it ends, so an ablation cut by a time limit keeps what it measured."""
    for out in set(outs):
        out.mkdir(parents=True, exist_ok=True)
        (out / "runs.jsonl").write_text("")

    def keep(i: int, r: RunResult | dict[str, Any]) -> None:
        with (outs[i] / "runs.jsonl").open("a") as f:
            f.write(json.dumps(asdict(r) if isinstance(r, RunResult) else r) + "\n")

    results: list[RunResult | dict[str, Any] | None] = [None] * len(jobs)
    if n > 1:
        # spawned, not forked: a parent that has touched CUDA cannot hand it to forked children
        with ProcessPoolExecutor(max_workers=n, mp_context=multiprocessing.get_context("spawn")) as pool:
            futs = {pool.submit(_job, j): i for i, j in enumerate(jobs)}
            for fut in as_completed(futs):
                i = futs[fut]
                results[i] = fut.result()
                keep(i, results[i])
    else:
        for i, j in enumerate(jobs):
            results[i] = _job(j)
            keep(i, results[i])
    return [r for r in results if r is not None]


def _load_runs(out: Path) -> list[Outcome]:
    """The runs an earlier ablation streamed to ``out/runs.jsonl`` (those it finished)."""
    path = out / "runs.jsonl"
    if not path.is_file():
        raise RuntimeError(f"no {path}: nothing to report")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [d if "error" in d else RunResult(**d) for d in rows]


def ablate(ab: AblateConfig, session_overrides: list[str]) -> tuple[list[RunResult], list[dict[str, Any]], Path]:
    session_overrides, gpus = _prepare(ab, session_overrides)
    jobs = _jobs(ab, session_overrides, gpus)
    return _report(ab, session_overrides, _run_jobs(jobs, ab.jobs, [Path(ab.out)] * len(jobs)))


Outcome = RunResult | dict[str, Any]  # a run's result, or its arm, seed and error


def _report(ab: AblateConfig, session_overrides: list[str],
            results: list[Outcome]) -> tuple[list[RunResult], list[dict[str, Any]], Path]:  # fmt: skip
    """One task's table, memory steps, results.json, plots (and MLflow run) from its runs."""
    failed = [r for r in results if isinstance(r, dict)]
    results = [r for r in results if isinstance(r, RunResult)]
    if not results:
        raise RuntimeError(f"every ablation run failed; the first: {failed[0]['error'] if failed else '?'}")
    out = Path(ab.out)
    out.mkdir(parents=True, exist_ok=True)
    best_known = None if ab.guard == "sim" else min(r.latency_ms for r in results if math.isfinite(r.latency_ms))
    if best_known is not None:
        for r in results:
            # against the best any run reached
            r.best_ms, r.ratio, r.found = best_known, r.latency_ms / best_known, r.found / best_known
    rows = summarize(results)
    steps = memory_steps(results)
    doc = {"config": asdict(ab), "overrides": session_overrides, "rows": rows, "memory_steps": steps,
           "runs": [asdict(r) for r in results], "failed_runs": failed}  # fmt: skip
    (out / "results.json").write_text(json.dumps(doc, indent=1))
    note = "".join(f"\nfailed run: {f['arm']} seed {f['seed']}: {f['error']}" for f in failed)
    curve = f"\n\nThe memory curve, paired by seed:\n\n{steps_table(steps)}\n" if steps else "\n"
    (out / "table.md").write_text(table(rows) + curve + note + ("\n" if note else ""))
    try:
        from kernelarc.ablate_plots import plots

        pngs = plots(results, rows, out)
    except ImportError as e:  # a machine without matplotlib still gets the table and the JSON
        log.warning("no plots: %s", e)
        pngs = []
    if ab.mlflow:
        _log_mlflow(ab, session_overrides, rows, [out / "results.json", out / "table.md", *pngs])
    return results, rows, out


def _log_mlflow(ab: AblateConfig, overrides: list[str], rows: list[dict[str, Any]], files: list[Path]) -> None:
    import mlflow

    if ab.tracking_uri:
        mlflow.set_tracking_uri(ab.tracking_uri)
    mlflow.set_experiment("kernelarc-ablation")
    with mlflow.start_run(run_name=f"ablation-{ab.guard}-{ab.mode}"):
        mlflow.log_params({f"ablate.{k}": str(v) for k, v in asdict(ab).items() if k != "tracking_uri"})
        mlflow.log_param("overrides", " ".join(overrides)[:500])
        for r in rows:
            tag = r["arm"].replace(" ", "_").replace("=", "")
            for k in ("mean", "median", "std", "within_1pct", "within_5pct", "p_vs_generalist"):
                v = r[k]
                if v is not None and math.isfinite(v):
                    mlflow.log_metric(f"{tag}.{k}", float(v))
        for f in files:
            mlflow.log_artifact(str(f))


def parse(argv: list[str]) -> tuple[AblateConfig, list[str]]:
    """``ablate.KEY=VALUE`` into :class:`AblateConfig` (typed, validated); everything else is passed
    to every session's config."""
    mine = [a[len("ablate.") :] for a in argv if a.startswith("ablate.")]
    rest = [a for a in argv if not a.startswith("ablate.")]
    base = OmegaConf.structured(AblateConfig)
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(mine))
    except Exception as e:  # noqa: BLE001 - unknown keys and values of the wrong type
        raise SystemExit(f"kernelarc.ablate: invalid argument: {e}") from None
    return OmegaConf.to_object(merged), rest  # type: ignore[return-value]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    ab, rest = parse(sys.argv[1:] if argv is None else argv)
    if ab.tasks and any(o.lstrip("+").startswith("task=") for o in rest):
        raise SystemExit("kernelarc.ablate: give either ablate.tasks=[...] or +task=NAME, not both")
    todo = [(f"{ab.out}/{t}", [f"+task={t}", *rest]) for t in ab.tasks] or [(ab.out, rest)]
    t = time.monotonic()
    # every task's runs in one pool: with several tasks no wave of runs waits for a task's last stragglers
    subs, jobs, outs = [], [], []
    for out_dir, over in todo:
        sub = AblateConfig(**{**asdict(ab), "out": out_dir, "tasks": []})
        over, gpus = _prepare(sub, over)
        mine = _jobs(sub, over, gpus, first=len(jobs))
        subs.append((sub, over, len(jobs), len(jobs) + len(mine)))
        jobs += mine
        outs += [Path(out_dir)] * len(mine)
    done = [] if ab.report_only else _run_jobs(jobs, ab.jobs, outs)
    rc = 0
    for sub, over, a, b in subs:
        try:
            results, rows, out = _report(sub, over, _load_runs(Path(sub.out)) if ab.report_only else done[a:b])
        except RuntimeError as e:  # every run of this task failed: say so, go on with the next task
            print(f"\n## {' '.join(over)}: {e}", flush=True)
            rc = 1
            continue
        print(f"\n## {' '.join(over)}\n")
        print(table(rows), flush=True)
        steps = memory_steps(results)
        if steps:
            print(f"\nThe memory curve, paired by seed:\n\n{steps_table(steps)}", flush=True)
        print(f"\n{len(results)} runs; results, table and plots in {out}/", flush=True)
    if not ab.report_only:
        print(f"\n{len(done)} runs in {time.monotonic() - t:.0f} s", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
