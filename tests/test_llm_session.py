"""Full CPU search sessions with Claude agents against a local fake Messages API server."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from fake_anthropic import fake_anthropic_server, kernel_reply, overloaded, text_reply

ROOT = Path(__file__).resolve().parents[1]
KEY = "sk-ant-test-secret-key-1234567890"
GOOD = """import torch
def run(x, weight):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + {eps}) * weight.float()).to(x.dtype)
"""
WRONG = "import torch\ndef run(x, weight):\n    return (x.float() * weight.float()).to(x.dtype)\n"


def _session(tmp_path, base_url, *extra, timeout=400):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), ANTHROPIC_API_KEY=KEY,
               ANTHROPIC_BASE_URL=base_url)  # fmt: skip
    cmd = [sys.executable, "-m", "kernelarc", "+task=rmsnorm", "agents.backend=anthropic", "agents.count=2",
           "agents.per_round=1", "agents.max_retries=1", "guard.compile_baseline=false", "guard.target_ms=5",
           "guard.max_iters=10", "search.dispatch=false", *extra]  # fmt: skip
    # (no shape dispatch: the scripted replies assume every budget slot is Claude's)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_llm_session_end_to_end(tmp_path):
    replies = [
        kernel_reply(GOOD.format(eps="1e-6"), conclusion=""),
        text_reply("no tool call here"),  # malformed: answered with one repair turn
        kernel_reply(GOOD.format(eps="0.000001"), conclusion="first attempt: plain torch is memory-bound"),
        overloaded(),  # outage: retried
        kernel_reply(WRONG, conclusion="trying without the normalisation"),
        kernel_reply(GOOD.format(eps="1.0e-6"), conclusion="dropping the rsqrt made it incorrect: keep the norm"),
    ]
    with fake_anthropic_server(replies) as srv:
        r = _session(tmp_path, srv.base_url, "budget.candidates=4")
        requests = list(srv.requests)
    assert r.returncode == 0, r.stderr[-3000:]
    assert len(requests) >= 5
    first = requests[0]
    assert any("cache_control" in b for b in first.system_blocks)
    board = [json.loads(x) for f in (tmp_path / ".kernelarc").rglob("board.jsonl") for x in f.read_text().splitlines()]
    lessons = " | ".join(b["lesson"] for b in board)
    assert "keep the norm" in lessons or "memory-bound" in lessons
    # Verdict feedback reaches the agents: a later prompt carries an earlier verdict.
    assert any("incorrect" in q.prompt_text or "correct_slower" in q.prompt_text for q in requests[2:])
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = c.get_experiment_by_name("kernelarc/rmsnorm/cpu")
    runs = c.search_runs([exp.experiment_id])
    llm_runs = [x for x in runs if x.data.tags.get("kernelarc.agent", "").startswith("agent")]
    assert llm_runs and all(x.data.tags["kernelarc.language"] == "pytorch" for x in llm_runs)
    assert any(x.data.tags["kernelarc.verdict"] == "incorrect" for x in llm_runs)
    assert all("llm.usd" in x.data.metrics for x in llm_runs)  # per-candidate cost
    # The key never reaches the store, the artifacts or the output.
    for p in tmp_path.rglob("*"):
        if p.is_file():
            assert KEY.encode() not in p.read_bytes(), p
    assert KEY not in r.stdout + r.stderr


@pytest.mark.slow
def test_usd_budget_stops_the_session(tmp_path):
    replies = [kernel_reply(GOOD.format(eps=f"{1e-6 + i * 1e-9!r}"), conclusion="x") for i in range(12)]
    with fake_anthropic_server(replies) as srv:
        r = _session(tmp_path, srv.base_url, "budget.candidates=10", "budget.usd=0.005")
        n = len(srv.requests)
    assert r.returncode == 0, r.stderr[-3000:]
    assert n <= 4  # one round of two agents costs ~0.016 USD > 0.005: no second round
    import re

    from mlflow import MlflowClient

    spent = re.search(r"^usd\s+(\S+)\s*$", r.stdout, re.MULTILINE)
    assert spent, r.stdout[-2000:]
    usd = float(spent[1])
    assert usd >= 0.005  # the budget was reached: that is why the session stopped before 10 candidates
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = c.get_experiment_by_name("kernelarc/rmsnorm/cpu")
    (parent,) = [x for x in c.search_runs([exp.experiment_id]) if x.data.tags.get("kernelarc.kind") == "session"]
    assert parent.data.metrics["usd"] == pytest.approx(usd, rel=1e-3)  # the table shows what MLflow recorded
    assert parent.data.metrics["evaluated"] < 10
