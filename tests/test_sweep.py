"""Sweep agents (agents.backend=sweep): the points they propose, their errors, and a CPU session."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kernelarc.agents.base import AgentContext
from kernelarc.agents.sweep import SweepError, build_sweep_agents, sweep_points
from kernelarc.families.cutlass_fmha import CUTLASS_FMHA
from kernelarc.tasks import load_builtin

ROOT = Path(__file__).resolve().parents[1]


def test_grid_is_the_feasible_product_with_the_rest_at_the_start():
    pts = sweep_points(CUTLASS_FMHA, {"BLOCK_KV": [128, 256], "STAGES_KV": [3, 4]})
    # 256-key tiles fit only with 3 stages (non-persistent): three of the four combinations remain
    assert [(p["BLOCK_KV"], p["STAGES_KV"]) for p in pts] == [(128, 3), (128, 4), (256, 3)]
    assert all(p["SCHEDULE"] == CUTLASS_FMHA.start["SCHEDULE"] for p in pts)
    assert sweep_points(CUTLASS_FMHA, {}) == [CUTLASS_FMHA.start]  # an empty grid is the start point


def test_points_are_completed_from_the_start_and_not_repeated():
    pts = sweep_points(CUTLASS_FMHA, points=[{"STAGES_KV": 4}, {"STAGES_KV": 4}, {"BLOCK_KV": 256, "STAGES_KV": 8}])
    assert pts == [{**CUTLASS_FMHA.start, "STAGES_KV": 4}]  # the repeat and the infeasible point are dropped


@pytest.mark.parametrize(
    ("grid", "message"),
    [({"NOPE": [1]}, "no knob 'NOPE'"), ({"STAGES_KV": [2]}, "not \\[2\\]"), ({"STAGES_KV": []}, "empty")],
)
def test_bad_grids_are_clear_errors(grid, message):
    with pytest.raises(SweepError, match=message):
        sweep_points(CUTLASS_FMHA, grid)


def test_agents_share_the_points_and_propose_each_once():
    task = load_builtin("rmsnorm", cpu=True)
    with pytest.raises(SweepError, match="families: rmsnorm.rowblock"):
        build_sweep_agents("rmsnorm", 2, "rmsnorm.nope", None, None)
    agents = build_sweep_agents("rmsnorm", 3, "rmsnorm.rowblock", {"num_warps": [1, 2, 4, 8], "rows": [1, 2]}, None)
    assert len(agents) == 3 and all(a.strategy == "tiling" for a in agents)
    seen: set[str] = set()
    proposed = []
    for a in agents:
        while True:
            ctx = AgentContext(task, None, None, None, [], [], frozenset(seen))
            got = a.propose(ctx, 2).candidates
            if not got:
                break
            seen.update(c.id for c in got)
            proposed += [(c.knobs["num_warps"], c.knobs["rows"]) for c in got]
    assert sorted(proposed) == sorted((w, r) for w in (1, 2, 4, 8) for r in (1, 2))  # all 8, none twice
    # more agents than points: one point each, no idle agent
    assert len(build_sweep_agents("rmsnorm", 8, "rmsnorm.rowblock", {"num_warps": [1, 2]}, None)) == 2


def test_a_cpu_sweep_session_measures_every_point_then_stops(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "kernelarc", "+task=rmsnorm", "guard.compile_baseline=false", "agents.backend=sweep",
           "agents.count=2", "agents.sweep.family=rmsnorm.rowblock", "agents.sweep.grid={num_warps:[1,2],rows:[1,2]}",
           "executor.parallel=2", "guard.target_ms=5", "guard.max_iters=20", "budget.candidates=50"]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "agents have nothing new to propose; stopping" in r.stdout
    lines = [ln for ln in r.stdout.splitlines() if "agent" in ln and "-sweep" in ln and "rmsnorm.rowblock" in ln]
    assert len(lines) == 4, r.stdout[-3000:]
    bad = subprocess.run([*cmd[:6], "agents.sweep.family=rmsnorm.rowblock", "agents.sweep.grid={num_warps:[3]}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "num_warps takes" in bad.stderr
