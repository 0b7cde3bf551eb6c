"""kill -9 in the middle of a search session, start it again: nothing measured is lost or measured twice."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["+task=rmsnorm", "guard.compile_baseline=false", "agents.count=2", "executor.parallel=1",
        "guard.target_ms=5", "guard.max_iters=20", "budget.candidates=5", "seed=3"]  # fmt: skip


def _env():
    return dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))


def _records(tmp_path):
    files = list((tmp_path / ".kernelarc").rglob("evaluations.jsonl"))
    if not files:
        return []
    return [json.loads(x) for x in files[0].read_text().splitlines() if x.strip()]


@pytest.mark.slow
def test_kill_and_resume(tmp_path):
    p = subprocess.Popen([sys.executable, "-m", "kernelarc", *ARGS], cwd=tmp_path, env=_env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.time() + 300
    while time.time() < deadline:
        if sum(r["kind"] == "candidate" for r in _records(tmp_path)) >= 2:
            break
        time.sleep(0.5)
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()
    before = _records(tmp_path)
    n_before = sum(r["kind"] == "candidate" for r in before)
    assert 2 <= n_before < 5
    r = subprocess.run([sys.executable, "-m", "kernelarc", *ARGS], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert "resuming session" in r.stdout
    after = _records(tmp_path)
    assert after[: len(before)] == before  # nothing lost
    cands = [r["candidate"]["source"] for r in after if r["kind"] == "candidate"]
    assert len(cands) == 5 and len(set(cands)) == 5  # nothing measured twice, budget respected
    baselines = [r for r in after if r["kind"] == "baseline"]
    assert len(baselines) == 1  # the reference was not re-measured
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = c.get_experiment_by_name("kernelarc/rmsnorm/cpu")
    parents = [x for x in c.search_runs([exp.experiment_id]) if not x.data.tags.get("mlflow.parentRunId")]
    assert len(parents) == 1  # the same parent run was resumed


@pytest.mark.slow
def test_sweep_runs_each_combination(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kernelarc", "-m", "+task=rmsnorm", "guard.compile_baseline=false",
                        "agents.count=1,2", "budget.candidates=1", "guard.target_ms=5", "guard.max_iters=10"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("alias_moved") == 2
    assert len(list((tmp_path / ".kernelarc").rglob("evaluations.jsonl"))) == 2
