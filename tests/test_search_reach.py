"""Search reach on a simulated GPU: the product's own loop (``SearchSession``: agents, board, plateau
breaker, dedupe, rematches, champion rule) with only the guard replaced by the cost model of
``kernelarc.simguard`` (a crude Hopper GEMM model that is deliberately NOT the search's surrogate).
Its optimum needs several coupled knobs at once (a 128x256 tile only pays with 8 warps and fewer
stages), which a one-knob-at-a-time walk cannot cross; the library is 30% slower than it.
"""

from __future__ import annotations

import statistics

from kernelarc.ablate import AblateConfig, run_one
from kernelarc.simguard import LIBRARY_GAP, CostModel, SimulatedGuard, gemm_latency
from kernelarc.tasks import load_builtin


def test_the_cost_model_has_a_coupled_optimum_noise_and_failures():
    task = load_builtin("matmul", cpu=True)
    model = CostModel(task)
    fam = model.families["matmul.persistent_tma"]
    best = dict(fam.start, BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3, GROUP_M=8)
    assert fam.valid(best) and abs(model.point_latency(fam.name, best) / model.optimum() - 1) < 1e-9
    # the wide tile alone (4 warps: spills) or the warps alone do not pay: the knobs are coupled
    spill = dict(best, num_warps=4, num_stages=2)
    assert not fam.valid(spill) or gemm_latency(fam.name, spill) > 1.5 * model.optimum()
    assert gemm_latency(fam.name, dict(best, BLOCK_N=128)) > 1.1 * model.optimum()
    assert model.point_latency(fam.name, dict(fam.start)) > 3 * model.optimum()
    assert model.point_latency(fam.name, dict(best, BLOCK_K=128, num_stages=6)).value == "compile_error"
    guard = SimulatedGuard(task, model)
    from kernelarc.models import Candidate

    c = Candidate(source="x", language="triton", family=fam.name, knobs=best)
    ref = Candidate(source="ref", language="pytorch", strategy="reference")
    ev = guard.evaluate(c, ref)
    assert ev.verdict.status.value == "champion" and abs(ev.verdict.speedup_vs_champion - LIBRARY_GAP) < 0.03
    assert len(set(ev.samples[0])) > 1  # noisy samples, judged by the product's promotion rule


def test_offline_team_reaches_the_coupled_optimum_within_a_gpu_budget():
    ab = AblateConfig(seeds=4, budget=96)
    runs = [run_one(ab, ["+task=matmul"], 4, 16, True, seed) for seed in range(4)]
    ratios = [r.ratio for r in runs]
    assert all(r.evaluated == 96 for r in runs)
    # the champion is a family kernel that beats the library (1.30x the optimum) in most runs, and most runs reach
    # the optimum: over 16 seeds at this budget the team beats the library in 15 (h10's measurement), so asking it
    # of all four seeds would test the seeds' luck, not the search
    assert sum(x < LIBRARY_GAP for x in ratios) >= 3, ratios
    assert statistics.median(ratios) < 1.02, ratios


def test_a_simulated_session_is_repeatable_for_its_seed():
    """Noise is seeded per candidate and verdicts are taken in submission order, so thread timing changes
    nothing: the same seed gives the same candidates, verdicts and curve; another seed another run."""
    ab = AblateConfig(budget=24)
    runs = []
    for seed in (3, 3, 4):
        sessions: list = []
        r = run_one(ab, ["+task=matmul"], 4, 16, True, seed, sessions=sessions)
        runs.append((r.curve, [(x.candidate.id, x.verdict.status, x.verdict.latency_ms) for x in sessions[0].records]))
    assert runs[0] == runs[1]
    assert runs[0][1] != runs[2][1]
