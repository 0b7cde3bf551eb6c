"""Budgets hold: bad budgets are usage errors before anything runs; torch.compile counts against budget.minutes
(the reference's own measurement does not: tests/test_budget_clock.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kernelarc.app import UsageError, typed
from kernelarc.config import register_configs

ROOT = Path(__file__).resolve().parents[1]
register_configs()


def _typed(*overrides: str):
    with initialize_config_dir(version_base=None, config_dir=str(ROOT / "conf")):
        return typed(compose(config_name="config", overrides=["+task=rmsnorm", *overrides]))


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("budget.candidates=-1", "budget.candidates"),
        ("budget.candidates=0", "budget.candidates"),
        ("budget.minutes=0", "budget.minutes"),
        ("budget.minutes=-2.5", "budget.minutes"),
        ("budget.minutes=nan", "budget.minutes"),
        ("budget.usd=0", "budget.usd"),
        ("agents.count=0", "agents.count"),
        ("agents.per_round=0", "agents.per_round"),
        ("executor.parallel=0", "executor.parallel"),
        ("memory.limit=-1", "memory.limit"),
        ("guard.seeds=0", "guard.seeds"),
        ("guard.timeout_s=0", "guard.timeout_s"),
        ("guard.max_iters=2", "guard.max_iters"),  # below guard.min_iters (5)
        ("suite.workloads=0", "suite.workloads"),
    ],
)
def test_bad_budgets_and_counts_are_usage_errors(override, key):
    with pytest.raises(UsageError, match=key.replace(".", r"\.")):
        _typed(override)


def test_sane_values_pass():
    c = _typed("budget.candidates=1", "budget.minutes=0.01", "memory.limit=0", "budget.usd=0.5")
    assert c.budget.candidates == 1 and c.memory.limit == 0


def _env():
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))


def test_negative_budget_exits_2_before_anything_runs(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kernelarc", "+task=rmsnorm", "budget.candidates=-1"], cwd=tmp_path,
                       env=_env(), capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and "budget.candidates must be a positive integer" in r.stderr
    assert not (tmp_path / ".kernelarc").exists() and not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_baselines_get_only_the_time_left(tmp_path):
    """budget.minutes=0.02 (1.2 s): the reference (which the session cannot do without) is measured,
    torch.compile is not started with no time left, and the session ends within one timeout."""
    timeout_s = 60
    cmd = [sys.executable, "-m", "kernelarc", "+task=rmsnorm", "budget.minutes=0.02", "budget.candidates=40",
           f"guard.timeout_s={timeout_s}", "guard.compile_baseline=true", "agents.count=2", "executor.parallel=1",
           "guard.target_ms=5", "guard.max_iters=20", "guard.compile_after_budget=false"]  # fmt: skip
    r = subprocess.run(cmd, cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "torch.compile: skipped (no time left in budget.minutes=0.02)" in r.stdout
    (meta,) = (tmp_path / ".kernelarc").rglob("session.json")
    state = json.loads(meta.read_text())
    assert state["status"] == "finished"
    # the session's wall time: the budget, the reference's measurement, at most one timeout past them
    assert state["elapsed_s"] <= 0.02 * 60 + 2 * timeout_s
    assert state["budget_s"] <= state["elapsed_s"]
    records = [json.loads(x) for x in (meta.parent / "evaluations.jsonl").read_text().splitlines()]
    assert [x["candidate"]["strategy"] for x in records if x["kind"] == "baseline"] == ["reference"]
    assert sum(x["kind"] == "candidate" for x in records) < 40
