"""executor=ray on the CPU: guards as local Ray actors judging real candidates of a built-in task.

A 2-actor search session end to end (MLflow runs, registry champion, resume), and an actor killed
in the middle of the work: its candidate gets a runtime_error verdict and the next one is judged by
a fresh actor that got the baselines measured before.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]


def _session(tmp_path: Path, *args: str, timeout: int = 480) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT), RAY_USAGE_STATS_ENABLED="0")
    cmd = [sys.executable, "-m", "kernelarc", "+task=rmsnorm", "gpu=cpu", "executor=ray", "executor.actors=2",
           "executor.parallel=1", "executor.prestart=1", "guard.compile_baseline=false", "agents.count=2",
           "guard.target_ms=5", "guard.max_iters=20", "guard.seeds=1", "search.dispatch=false",
           *args]  # fmt: skip
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_two_actor_session_tracks_registers_and_resumes(tmp_path):
    r = _session(tmp_path, "budget.candidates=3")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "(cpu, cpu)" in r.stdout  # two guards, one per actor
    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    exp = c.get_experiment_by_name("kernelarc/rmsnorm/cpu")
    runs = c.search_runs([exp.experiment_id])
    (parent,) = [x for x in runs if x.data.tags.get("kernelarc.kind") == "session"]
    assert parent.info.run_name == "rmsnorm-cpu-2a-m16" and parent.data.params["executor.name"] == "ray"
    children = [x for x in runs if x.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 3 + 1  # the reference baseline and three candidates
    from kernelarc.models import Status

    verdicts = [x.data.tags["kernelarc.verdict"] for x in children]
    assert set(verdicts) <= {s.value for s in Status}
    assert sum(v in ("champion", "correct_slower") for v in verdicts) >= 2  # the reference and a candidate, judged
    assert int(c.get_model_version_by_alias("kernelarc.rmsnorm.cpu", "champion").version) == 1

    # The same command again resumes the finished session: nothing measured twice, same parent run.
    r2 = _session(tmp_path, "budget.candidates=3")
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert "resum" in r2.stdout
    runs2 = c.search_runs([exp.experiment_id])
    assert len([x for x in runs2 if x.data.tags.get("kernelarc.kind") == "session"]) == 1
    assert len([x for x in runs2 if x.data.tags.get("mlflow.parentRunId")]) == len(children)


@pytest.mark.slow
def test_a_dead_actor_is_a_verdict_and_the_next_actor_has_the_baselines():
    from kernelarc.executors.ray import RayGuard
    from kernelarc.guard.judge import reference_candidate
    from kernelarc.guard.settings import GuardSettings
    from kernelarc.hardware import resolve_target
    from kernelarc.models import Candidate, Status
    from kernelarc.tasks.loader import load_builtin

    os.environ.setdefault("TRITON_INTERPRET", "1")
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"TRITON_INTERPRET": "1"}})
    try:
        task = load_builtin("rmsnorm", cpu=True)
        gcfg = GuardSettings(target_ms=5, max_iters=20, workloads=[0], consistency=4.0, prestart=1, seeds=1)
        guard = RayGuard(task, resolve_target("cpu"), "cpu", gcfg, seed=0)
        assert guard.workloads == [0]
        ref = guard.evaluate(reference_candidate(task), None, trusted=True, timeout_s=300)
        assert ref.verdict.correct and ref.samples
        guard.set_baselines(ref, None)
        assert set(guard.baseline_ms) == {0} and guard.baseline_ms[0] > 0

        node = guard.node()
        assert node["pid"] != os.getpid()
        os.kill(node["pid"], signal.SIGKILL)  # the node loses the actor while the session goes on
        scaled = reference_candidate(task).source.replace("return (", "return 1.0 * (")
        cand = Candidate(source=scaled, language="pytorch", agent="a0", strategy="memory")
        dead = guard.evaluate(cand, None, timeout_s=300)
        assert dead.verdict.status is Status.runtime_error
        assert "guard actor 0 died" in dead.verdict.errors[0]
        assert guard.restarts == 1

        # A fresh actor judges the next candidate, with the reference as its baseline again.
        assert guard.node()["pid"] != node["pid"]
        again = guard.evaluate(cand, None, timeout_s=300)
        assert again.verdict.correct, again.verdict.errors
        assert set(guard.baseline_ms) == {0}
        assert again.verdict.speedup_vs_baseline is not None and again.verdict.speedup_vs_baseline > 0
        guard.close()
    finally:
        ray.shutdown()


@pytest.mark.gpu
def test_gpu_actor_judges_on_its_own_gpu():
    """One actor per GPU (num_gpus=1): Ray gives it its GPU as cuda:0; the reference runs and is timed there."""
    import torch

    from kernelarc.config import ExecutorConfig
    from kernelarc.executors.ray import RayGuard, connect, ray_devices
    from kernelarc.guard.judge import reference_candidate
    from kernelarc.guard.settings import GuardSettings
    from kernelarc.hardware import resolve_target
    from kernelarc.tasks.loader import load_builtin

    connect(None)
    try:
        target = resolve_target("auto")
        devices = ray_devices(ExecutorConfig(name="ray"), target)
        assert devices == ["cuda:0"] * torch.cuda.device_count()
        task = load_builtin("rmsnorm")
        guard = RayGuard(task, target, devices[0], GuardSettings(workloads=[0], prestart=1), seed=0)
        node = guard.node()
        assert node["pid"] != os.getpid() and node["cuda"] not in (None, "")
        ev = guard.evaluate(reference_candidate(task), None, trusted=True, timeout_s=600)
        assert ev.verdict.correct, ev.verdict.errors
        assert ev.verdict.latency_ms and 0 < ev.verdict.latency_ms < 100  # GPU time, not the interpreter's
        guard.close()
    finally:
        ray.shutdown()
