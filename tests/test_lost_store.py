"""A saved session resumed against a store that lacks its MLflow run (the suite's per-shard stores live on a
machine's /tmp; its state folders in the checkout): it goes on under a new run and registers its champion in
that store, instead of crashing on "Run with id=... not found" or pointing the alias at a version that
store never had."""

from __future__ import annotations

from mlflow import MlflowClient

from kernelarc.ablate import _compose
from kernelarc.app import resolve_gpu, typed
from kernelarc.config import plain
from kernelarc.simguard import simulated_guard_factory
from kernelarc.ui import Progress
from kernelarc.wiring import build_session


def _run(state, uri: str, candidates: int):
    cfg = _compose(["+task=matmul", "gpu=cpu", "search.calibrate=false", "agents.backend=search", "agents.count=2",
                    "executor.parallel=2", f"budget.candidates={candidates}", "budget.minutes=5",
                    f"tracking.uri={uri}", "search.progress=false", f"search.state_dir={state}"])  # fmt: skip
    c = typed(cfg)
    s = build_session(c, plain(cfg), resolve_gpu(c), progress=Progress(False), make_guard=simulated_guard_factory(0))
    return s, s.run()


def test_a_session_resumed_against_a_store_without_its_run_registers_there(tmp_path):
    state = tmp_path / "state"
    a, b = f"sqlite:///{tmp_path}/a.db", f"sqlite:///{tmp_path}/b.db"
    s1, sum1 = _run(state, a, 3)
    assert sum1["registry_version"] is not None
    s2, sum2 = _run(state, b, 3)  # the same command (so the same state folder), another (empty) store
    assert sum2["status"] == "finished" and sum2["evaluated"] == 3
    assert [r.candidate.id for r in s2.records[: len(s1.records)]] == [r.candidate.id for r in s1.records]
    assert sum2["mlflow_run_id"] != sum1["mlflow_run_id"]
    cb = MlflowClient(tracking_uri=b, registry_uri=b)
    run = cb.get_run(sum2["mlflow_run_id"])
    assert run.data.tags["kernelarc.resumed_from_lost_run"] == sum1["mlflow_run_id"]
    mv = cb.get_model_version_by_alias("kernelarc.matmul.cpu", "champion")
    assert mv.tags["candidate_id"] == s2.champion.id and int(mv.version) == sum2["registry_version"]
    ca = MlflowClient(tracking_uri=a, registry_uri=a)  # the first store is left as it was
    assert ca.get_model_version_by_alias("kernelarc.matmul.cpu", "champion").tags["candidate_id"] == s1.champion.id
