"""kill -9 in the middle of a search session, start it again: nothing measured is lost or measured twice."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernelarc.models import Candidate

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
    assert re.search(r"resum(ing|ed) session", r.stdout)
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
    # the alias points where an uninterrupted session puts it: at the state's champion
    assert _alias_candidate(c, "kernelarc.rmsnorm.cpu") == _state_champion(after).id


def _state_champion(records: list[dict]) -> Candidate:
    """The session's champion from its state log: the last record crowned (baselines included)."""
    crowned = [r["candidate"] for r in records if r["verdict"]["status"] == "champion" and r["kind"] != "final"]
    return Candidate.model_validate(crowned[-1])


def _alias_candidate(client, model: str) -> str:
    mv = client.get_model_version_by_alias(model, "champion")
    return mv.tags["candidate_id"]


def _problem(root: Path) -> Path:
    """A SOL-ExecBench problem no kernel family applies to: the offline agents have nothing to
    propose, so the reference baseline stays champion (deterministically)."""
    d = json.loads((ROOT / "kernelarc" / "tasks" / "builtin" / "rmsnorm" / "definition.json").read_text())
    d.update(name="plain_scale", reference="import torch\n\ndef run(x, weight):\n    return x * weight\n")
    root.mkdir()
    (root / "definition.json").write_text(json.dumps(d))
    inputs = {"x": {"type": "random"}, "weight": {"type": "random"}}
    (root / "workload.jsonl").write_text(json.dumps({"uuid": "w0", "axes": {"M": 8, "N": 64}, "inputs": inputs}))
    return root


@pytest.mark.slow
@pytest.mark.parametrize("champion", ["baseline", "candidate"])
def test_resume_after_a_kill_before_the_alias_moved_restores_it(tmp_path, champion):
    """A kill after the champion was measured (and registered) but before the session's end, where
    the alias moves: the same command again points the alias at that champion, registering
    nothing twice. Simulated exactly: the finished session's alias and saved versions removed."""
    if champion == "baseline":
        args = ["+task=sol_execbench", f"task.path={_problem(tmp_path / 'problem')}", "guard.compile_baseline=false",
                "agents.count=1", "budget.candidates=2", "guard.target_ms=5", "guard.max_iters=20"]  # fmt: skip
        model = "kernelarc.plain_scale.cpu"
    else:
        args = [*ARGS[:-2], "budget.candidates=2", "seed=5"]
        model = "kernelarc.rmsnorm.cpu"
    r = subprocess.run([sys.executable, "-m", "kernelarc", *args], cwd=tmp_path, env=_env(),
                       capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    records = _records(tmp_path)
    champ = _state_champion(records)
    if champion == "baseline":
        assert champ.strategy == "reference"
    assert _alias_candidate(c, model) == champ.id
    versions = [mv.version for mv in c.search_model_versions(f"name = '{model}'")]
    # the kill: no alias yet, and the state folder without the registry versions
    c.delete_registered_model_alias(model, "champion")
    (meta,) = (tmp_path / ".kernelarc").rglob("session.json")
    state = json.loads(meta.read_text())
    for key in ("versions", "status"):
        state.pop(key, None)
    meta.write_text(json.dumps(state))
    r2 = subprocess.run([sys.executable, "-m", "kernelarc", *args], cwd=tmp_path, env=_env(),
                        capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r2.returncode == 0, r2.stderr[-2000:]
    assert re.search(r"resum(ing|ed) session", r2.stdout)
    assert _alias_candidate(c, model) == champ.id
    assert [mv.version for mv in c.search_model_versions(f"name = '{model}'")] == versions


@pytest.mark.slow
def test_sweep_runs_each_combination(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kernelarc", "-m", "+task=rmsnorm", "guard.compile_baseline=false",
                        "agents.count=1,2", "budget.candidates=1", "guard.target_ms=5", "guard.max_iters=10"],
                       cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("alias_moved") == 2
    assert len(list((tmp_path / ".kernelarc").rglob("evaluations.jsonl"))) == 2
