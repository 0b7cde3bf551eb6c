"""The MLflow UI as a user sees it, in a real browser (headless Chromium from Debian's package).

A real CPU search session makes a small store; ``mlflow server`` serves it on 127.0.0.1; Chromium
loads the sessions table, the candidates table, one candidate's run page and the registered model's
page, and the rendered DOM must show what a user compares. Skipped where Chromium is not installed
(``apt-get install -y chromium``). ``KERNELARC_SCREENSHOTS=docs`` also writes the screenshots kept
in ``docs/``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="needs Chromium (apt-get install -y chromium)"),
    pytest.mark.skipif(shutil.which("mlflow") is None, reason="needs the mlflow CLI (the full mlflow package)"),
]
ML = "workflowType=machine_learning"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chromium(url: str, *, screenshot: Path | None = None, width: int = 2400) -> str:
    """The DOM after the page's scripts ran (or a PNG of it)."""
    args = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--virtual-time-budget=20000",
            f"--window-size={width},1100"]  # fmt: skip
    args += [f"--screenshot={screenshot}", url] if screenshot else ["--dump-dom", url]
    r = subprocess.run(args, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(base URL, experiment id, a candidate's run id, the session's run name) of a served real session."""
    work = tmp_path_factory.mktemp("ui")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "kernelarc", "+task=rmsnorm", "gpu=cpu", "guard.compile_baseline=false",
           "agents.count=2", "executor.parallel=2", "guard.target_ms=5", "guard.max_iters=20",
           "budget.candidates=2"]  # fmt: skip
    r = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    from mlflow import MlflowClient

    uri = f"sqlite:///{work / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("kernelarc/rmsnorm/cpu")
    runs = client.search_runs([exp.experiment_id])
    (session,) = [x for x in runs if x.data.tags.get("kernelarc.kind") == "session"]
    cand = next(
        x for x in runs if x.data.tags.get("kernelarc.candidate_id") and x.data.params.get("agent") != "baseline"
    )
    port = _free_port()
    server = subprocess.Popen(
        ["mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
        cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail("mlflow server did not answer on /health within 120 s")
        yield base, exp.experiment_id, cand, session.info.run_name
    finally:
        server.terminate()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


def _shots() -> Path | None:
    d = os.environ.get("KERNELARC_SCREENSHOTS")
    if not d:
        return None
    path = Path(d) if Path(d).is_absolute() else ROOT / d
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_sessions_and_candidates_tables_show_what_a_user_compares(served):
    from kernelarc.tracking import CANDIDATES_VIEW_KEY, ui_url

    base, exp_id, cand, session_name = served
    dom = _chromium(ui_url(exp_id, base))
    assert session_name == "rmsnorm-cpu-2a-m16" and session_name in dom
    for column in ("Duration", "latency_ms", "sol_fraction", "speedup_vs_baseline", "kernelarc.verdict"):
        assert column in dom, column  # selected by the saved view, not hidden
    cands = _chromium(ui_url(exp_id, base, CANDIDATES_VIEW_KEY))
    assert cand.info.run_name in cands  # candidates of every session, flat
    assert "baseline:" in cands and cands.count("correct_slower") + cands.count(">champion<") >= 2
    if shots := _shots():
        _chromium(ui_url(exp_id, base), screenshot=shots / "ui_sessions.png", width=1900)
        _chromium(ui_url(exp_id, base, CANDIDATES_VIEW_KEY), screenshot=shots / "ui_candidates.png", width=1900)


def test_candidate_run_page_shows_its_verdict_metrics_and_duration(served):
    base, exp_id, cand, session_name = served
    url = f"{base}/#/experiments/{exp_id}/runs/{cand.info.run_id}?{ML}"
    dom = _chromium(url, width=1600)
    assert cand.info.run_name in dom and session_name in dom  # the candidate and its parent session
    assert cand.data.tags["kernelarc.verdict"] in dom and cand.data.params["family"] in dom
    assert "latency_ms" in dom and "sol_fraction" in dom
    seconds = (cand.info.end_time - cand.info.start_time) / 1000
    assert seconds > 0.5  # the evaluation's time (it interprets Triton on the CPU), not logging time
    shown = {f"{seconds + d:.1f}s" for d in (-0.05, 0, 0.05)} | {f"{(seconds + d) / 60:.1f}min" for d in (-3, 0, 3)}
    assert any(s in dom for s in shown), shown
    if shots := _shots():
        _chromium(url, screenshot=shots / "ui_candidate.png", width=1600)


def test_model_page_shows_the_champion_version(served):
    base, *_ = served
    url = f"{base}/#/models/kernelarc.rmsnorm.cpu?{ML}"
    dom = _chromium(url, width=1600)
    assert "kernelarc.rmsnorm.cpu" in dom and "Version 1" in dom and "champion" in dom
    assert "Version 2" not in dom  # the session registered its reference once
    if shots := _shots():
        _chromium(url, screenshot=shots / "ui_model.png", width=1600)
