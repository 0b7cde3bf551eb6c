"""Tracker: DESIGN.md names on child runs, secrets redaction, resume, plots, overhead."""

from __future__ import annotations

import json
import shutil
import sqlite3
import statistics
import time
from pathlib import Path

import pytest

from kernelarc.models import Candidate, Status, Verdict, WorkloadResult
from kernelarc.tracking import MAX_PARAM_VAL, REDACTED, Tracker, redact

TASK, GPU = "rmsnorm", "cpu"
SECRET = "sk-ant-api03-TESTSECRET-0123456789abcdef"

REQUIRED_PARAMS = {"agent", "strategy", "language"}
REQUIRED_METRICS = {"correct", "latency_ms", "sol_fraction", "sol_score", "speedup_vs_baseline"}
REQUIRED_TAGS = {
    "kernelarc.verdict",
    "kernelarc.agent",
    "kernelarc.strategy",
    "kernelarc.language",
    "kernelarc.candidate_id",
}


def make_candidate(i: int = 0, **kw) -> Candidate:
    fields = dict(
        source=f"import torch\n\n\ndef run(x, w):\n    return x * w + {i}\n",
        language="pytorch",
        agent="agent0",
        strategy="tiling",
        family="rowwise",
        knobs={"BLOCK": 128, "num_warps": 4},
        parent="0123456789abcdef",
        rationale="bigger blocks",
    )
    fields.update(kw)
    return Candidate(**fields)


def make_verdict(candidate: Candidate, status: Status = Status.correct_slower, **kw) -> Verdict:
    fields = dict(
        candidate_id=candidate.id,
        status=status,
        latency_ms=0.5,
        tbps=1.5,
        sol_fraction=0.4,
        sol_score=0.6,
        speedup_vs_baseline=1.3,
        speedup_vs_compile=1.1,
        noise=0.02,
        eval_seconds=3.2,
        phases={"build": 0.4, "time": 1.0},
        workloads=[
            WorkloadResult(index=0, correct=True, latency_ms=0.4, tbps=1.6, sol_fraction=0.45, t_sol_ms=0.18),
            WorkloadResult(index=1, correct=True, latency_ms=0.6, tbps=1.4, sol_fraction=0.35),
        ],
    )
    fields.update(kw)
    return Verdict(**fields)


def all_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


def test_default_store_is_sqlite_in_cwd_with_local_artifacts(workdir):
    tr = Tracker(None, TASK, GPU)
    assert tr.uri == f"sqlite:///{workdir / 'mlflow.db'}"
    assert tr.experiment_name == "kernelarc/rmsnorm/cpu"
    exp = tr.client.get_experiment(tr.experiment_id)
    assert exp.name == "kernelarc/rmsnorm/cpu"
    assert exp.artifact_location == (workdir / "mlartifacts").as_uri()
    # WAL is what keeps per-candidate logging fast (see test_logging_overhead).
    with sqlite3.connect(workdir / "mlflow.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    # A second tracker on the same store reuses the experiment.
    assert Tracker(None, TASK, GPU).experiment_id == tr.experiment_id


def test_child_run_carries_design_names(workdir):
    tr = Tracker(None, TASK, GPU)
    parent = tr.start_session({"task": {"name": TASK}}, run_name="session-1")
    cand = make_candidate()
    verdict = make_verdict(cand)
    run_id = tr.log_candidate(cand, verdict, extra_metrics={"gain_vs_champion": -0.1, "skipped": None})

    run = tr.client.get_run(run_id)
    assert run.info.run_name == f"agent0:{cand.id}"
    assert run.info.status == "FINISHED"
    assert run.data.tags["mlflow.parentRunId"] == parent
    assert run.info.experiment_id == tr.experiment_id

    params = run.data.params
    assert params == {
        "agent": "agent0",
        "strategy": "tiling",
        "language": "pytorch",
        "family": "rowwise",
        "parent": "0123456789abcdef",
        "knob.BLOCK": "128",
        "knob.num_warps": "4",
    }
    m = run.data.metrics
    assert set(m) >= REQUIRED_METRICS
    assert m["correct"] == 1.0
    assert m["latency_ms"] == pytest.approx(0.5)
    assert m["tbps"] == pytest.approx(1.5)
    assert "tflops" not in m  # None values are skipped, not logged as 0
    assert m["speedup_vs_compile"] == pytest.approx(1.1)
    assert m["noise"] == pytest.approx(0.02)
    assert m["eval_seconds"] == pytest.approx(3.2)
    assert m["phase.build_s"] == pytest.approx(0.4)
    assert m["wl0.latency_ms"] == pytest.approx(0.4)
    assert m["wl1.latency_ms"] == pytest.approx(0.6)
    assert m["wl0.t_sol_ms"] == pytest.approx(0.18)
    assert "wl1.t_sol_ms" not in m
    assert m["wl0.correct"] == 1.0
    assert m["gain_vs_champion"] == pytest.approx(-0.1)
    assert "skipped" not in m

    tags = run.data.tags
    assert set(tags) >= REQUIRED_TAGS
    assert tags["kernelarc.verdict"] == "correct_slower"
    assert tags["kernelarc.agent"] == "agent0"
    assert tags["kernelarc.strategy"] == "tiling"
    assert tags["kernelarc.language"] == "pytorch"
    assert tags["kernelarc.candidate_id"] == cand.id

    arts = {a.path for a in tr.client.list_artifacts(run_id, "kernel")}
    assert arts == {"kernel/kernel.py", "kernel/verdict.json", "kernel/candidate.json"}
    kdir = Path(tr.client.download_artifacts(run_id, "kernel", str(workdir / "dl")))
    assert (kdir / "kernel.py").read_text() == cand.source
    assert Verdict.model_validate_json((kdir / "verdict.json").read_text()) == verdict
    meta = json.loads((kdir / "candidate.json").read_text())
    assert meta["id"] == cand.id and meta["knobs"] == {"BLOCK": 128, "num_warps": 4}
    # Artifacts live in the local folder next to the database.
    assert any(p.name == "kernel.py" for p in all_files(workdir / "mlartifacts"))


def test_failed_candidate_and_optional_fields(workdir):
    tr = Tracker(None, TASK, GPU)
    tr.start_session({})
    cand = make_candidate(family=None, parent=None, knobs={})
    verdict = Verdict(candidate_id=cand.id, status=Status.compile_error, errors=["SyntaxError: line 3"])
    run = tr.client.get_run(tr.log_candidate(cand, verdict))
    assert run.data.params == {"agent": "agent0", "strategy": "tiling", "language": "pytorch"}
    assert run.data.metrics == {"correct": 0.0}
    assert run.data.tags["kernelarc.verdict"] == "compile_error"
    assert run.data.tags["kernelarc.error"] == "SyntaxError: line 3"


def test_log_candidate_needs_a_session(workdir):
    tr = Tracker(None, TASK, GPU)
    cand = make_candidate()
    with pytest.raises(RuntimeError, match="start_session"):
        tr.log_candidate(cand, make_verdict(cand))


def test_config_params_flattened_and_truncated(workdir):
    tr = Tracker(None, TASK, GPU)
    config = {
        "agents": {"count": 4, "backend": "search", "max_tokens": 8192},
        "memory": {"limit": None},
        "strategies": ["tiling", "fusion"],
        "long": "x" * (MAX_PARAM_VAL + 500),
        "flag": True,
        "weird key!": 1,
        "weird key?": 2,
        "deep": {"k" * 300: "long key"},
        **{f"k{i}": i for i in range(150)},  # more than one log_batch's 100 params
    }
    pid = tr.start_session(config)
    params = tr.client.get_run(pid).data.params
    assert params["agents.count"] == "4"
    assert params["agents.backend"] == "search"
    assert params["agents.max_tokens"] == "8192"  # a token budget is not a secret
    assert params["memory.limit"] == "null"
    assert params["strategies"] == '["tiling", "fusion"]'
    assert params["flag"] == "true"
    assert params["weird key_"] == "1"
    assert params["weird key___2"] == "2"
    (long_key,) = [k for k in params if k.startswith("deep.")]
    assert len(long_key) == 250 and params[long_key] == "long key"
    assert len(params["long"]) == MAX_PARAM_VAL
    assert params["k149"] == "149"
    with pytest.raises(RuntimeError, match="still open"):
        tr.start_session({})


def test_omegaconf_config_is_accepted(workdir):
    omegaconf = pytest.importorskip("omegaconf")
    cfg = omegaconf.OmegaConf.create({"a": {"b": 1}, "c": "${a.b}"})
    tr = Tracker(None, TASK, GPU)
    params = tr.client.get_run(tr.start_session(cfg)).data.params
    assert params == {"a.b": "1", "c": "1"}


def test_redact_unit(monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    out = redact(
        {
            "api_key": "abc",
            "nested": {"auth_token": "t", "password": "p", "client_secret": "s", "max_tokens": 10},
            "secrets": {"anthropic": "plain-looking"},
            "note": SECRET,
            "header": f"Bearer {SECRET}",
            "other": "sk-ant-someone-elses-key",
            "list": [SECRET, "ok"],
            "fine": "value",
        }
    )
    assert out["api_key"] == REDACTED
    assert out["nested"] == {
        "auth_token": REDACTED,
        "password": REDACTED,
        "client_secret": REDACTED,
        "max_tokens": 10,
    }
    assert out["secrets"] == {"anthropic": REDACTED}
    assert out["note"] == REDACTED
    assert out["header"] == f"Bearer {REDACTED}"
    assert out["other"] == REDACTED
    assert out["list"] == [REDACTED, "ok"]
    assert out["fine"] == "value"


def test_secrets_never_reach_params_tags_or_artifacts(workdir, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    config = {
        "agents": {"backend": "anthropic", "anthropic": {"api_key": SECRET, "max_tokens": 8192}},
        "innocent_name": SECRET,
        "tracking": {"token": "hunter2-token-value", "password": "hunter2-password"},
        "other_key": "sk-ant-api03-another-one",
        SECRET: "key used as a dict key",
    }
    tr = Tracker(None, TASK, GPU)
    pid = tr.start_session(config)
    cand = make_candidate(rationale=f"called the API with {SECRET}", source=f"# {SECRET}\ndef run(x):\n    return x\n")
    verdict = make_verdict(cand, errors=[f"AuthenticationError: bad key {SECRET}"])
    child = tr.log_candidate(cand, verdict)
    tr.log_best_so_far_plot([(0, 1.0), (1, 0.5)])
    tr.end_session(summary={"best_latency_ms": 0.5, "note": f"key={SECRET}"})

    forbidden = [SECRET, "sk-ant-", "hunter2"]
    for run_id in (pid, child):
        run = tr.client.get_run(run_id)
        for key, value in [*run.data.params.items(), *run.data.tags.items()]:
            for bad in forbidden:
                assert bad not in key and bad not in value, (run_id, key, value)
        for key in run.data.metrics:
            assert not any(bad in key for bad in forbidden)
    params = tr.client.get_run(pid).data.params
    assert params["agents.anthropic.api_key"] == REDACTED
    assert params["innocent_name"] == REDACTED
    assert params["agents.anthropic.max_tokens"] == "8192"

    files = all_files(workdir / "mlartifacts")
    assert {p.name for p in files} >= {"kernel.py", "verdict.json", "candidate.json", "summary.json", "best_so_far.png"}
    for path in files:
        data = path.read_bytes()
        for bad in forbidden:
            assert bad.encode() not in data, path
    # And nothing in the database file itself (params, tags, run names, descriptions...).
    for path in workdir.glob("mlflow.db*"):
        data = path.read_bytes()
        for bad in forbidden:
            assert bad.encode() not in data, path


def test_resume_reopens_parent_and_finds_candidates(workdir):
    tr = Tracker(None, TASK, GPU)
    pid = tr.start_session({"budget": {"candidates": 10}, "seed": 0})
    cands = [make_candidate(i) for i in range(3)]
    run_ids = {c.id: tr.log_candidate(c, make_verdict(c)) for c in cands}
    tr.end_session("KILLED")
    assert tr.client.get_run(pid).info.status == "KILLED"

    tr2 = Tracker(None, TASK, GPU)
    assert tr2.find_candidate_runs(pid) == run_ids
    assert tr2.start_session({"budget": {"candidates": 20}, "seed": 0, "new": 1}, resume_run_id=pid) == pid
    run = tr2.client.get_run(pid)
    assert run.info.status == "RUNNING"
    assert run.data.params["budget.candidates"] == "10"  # params are immutable
    assert run.data.params["new"] == "1"
    assert json.loads(run.data.tags["kernelarc.resume1.config_changes"]) == {"budget.candidates": "20"}
    extra = make_candidate(99)
    run_ids[extra.id] = tr2.log_candidate(extra, make_verdict(extra))
    assert tr2.find_candidate_runs() == run_ids
    tr2.end_session()

    other = Tracker(None, "softmax", GPU)
    with pytest.raises(ValueError, match="belongs to experiment"):
        other.start_session({}, resume_run_id=pid)


def test_resume_from_a_store_without_the_run_opens_a_new_run_that_names_it(workdir):
    # The state folder outlived its store (the suite's per-shard stores live on a machine's /tmp): the
    # session goes on under a new run instead of crashing on "Run with id=... not found".
    tr = Tracker(None, TASK, GPU)
    pid = tr.start_session({"seed": 0})
    tr.end_session("KILLED")
    fresh = Tracker(f"sqlite:///{workdir}/fresh.db", TASK, GPU)
    new = fresh.start_session({"seed": 0}, resume_run_id=pid)
    assert new != pid
    run = fresh.client.get_run(new)
    assert run.data.tags["kernelarc.resumed_from_lost_run"] == pid
    assert run.data.params["seed"] == "0"
    fresh.end_session()


def test_session_metrics_plot_and_end(workdir):
    tr = Tracker(None, TASK, GPU)
    pid = tr.start_session({})
    for step, best in enumerate([2.0, 1.5, 1.5, 0.9]):
        tr.log_session_metrics(step, best_latency_ms=best, candidates=step + 1, skipped=None)
    history = tr.client.get_metric_history(pid, "best_latency_ms")
    assert [(h.step, h.value) for h in history] == [(0, 2.0), (1, 1.5), (2, 1.5), (3, 0.9)]

    assert tr.log_best_so_far_plot([]) is None
    assert tr.log_best_so_far_plot([(0, 2.0), (1, 3.0), (2, 0.9), (3, float("nan"))]) == "best_so_far.png"
    arts = {a.path for a in tr.client.list_artifacts(pid)}
    assert "best_so_far.png" in arts
    png = Path(tr.client.download_artifacts(pid, "best_so_far.png", str(workdir / "dl"))).read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"

    tr.end_session(summary={"best_latency_ms": 0.9, "champion": "abc", "improved": True})
    run = tr.client.get_run(pid)
    assert run.info.status == "FINISHED"
    assert run.data.metrics["best_latency_ms"] == pytest.approx(0.9)
    assert run.data.tags["kernelarc.summary.champion"] == "abc"
    assert run.data.tags["kernelarc.summary.improved"] == "true"
    assert "summary.json" in {a.path for a in tr.client.list_artifacts(pid)}
    with pytest.raises(RuntimeError):
        tr.log_session_metrics(5, x=1)
    with pytest.raises(ValueError):
        tr.end_session("DONE")


def test_context_manager_marks_crash_failed(workdir):
    with pytest.raises(KeyError), Tracker(None, TASK, GPU) as tr:
        pid = tr.start_session({})
        raise KeyError("boom")
    assert tr.client.get_run(pid).info.status == "FAILED"


def test_explicit_uri(tmp_path, mlflow_template):
    shutil.copy(mlflow_template, tmp_path / "other.db")
    tr = Tracker(f"sqlite:///{tmp_path / 'other.db'}", TASK, GPU)
    assert tr.artifact_location == (tmp_path / "mlartifacts").as_uri()
    with pytest.raises(ValueError):
        Tracker(None, "", GPU)


def test_logging_overhead(workdir, capsys):
    """Per-candidate cost of log_candidate on SQLite: four store calls (create_run, one log_batch,
    set_terminated; artifacts written in place, no upload). Its wall time is printed for the record,
    not asserted: speed belongs in benchmarks, and CI is shared."""
    from collections import Counter

    tr = Tracker(None, TASK, GPU)
    tr.start_session({})
    cand = make_candidate(-1)
    tr.log_candidate(cand, make_verdict(cand))  # warm-up: engine and artifact repo setup
    calls: Counter[str] = Counter()
    for name in ("create_run", "log_batch", "set_terminated", "log_artifacts", "log_artifact", "log_metric"):
        real = getattr(tr.client, name)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)

        setattr(tr.client, name, counted)
    times, cpu = [], []
    for i in range(20):
        cand = make_candidate(i, knobs={"BLOCK": 64 * (i + 1), "num_warps": 4, "num_stages": 3})
        verdict = make_verdict(cand)
        t0, c0 = time.perf_counter(), time.process_time()
        tr.log_candidate(cand, verdict)
        times.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    assert calls == {"create_run": 20, "log_batch": 20, "set_terminated": 20}
    median_ms = statistics.median(times) * 1000
    with capsys.disabled():
        print(
            f"\nlog_candidate overhead over 20: wall median {median_ms:.1f} ms (max {max(times) * 1000:.1f}), "
            f"CPU median {statistics.median(cpu) * 1000:.1f} ms"
        )


def test_experiment_opens_in_the_classic_runs_view_with_compared_columns(workdir):
    from kernelarc.tracking import CANDIDATES_VIEW_KEY, EXPERIMENT_KIND_TAG, VIEW_TAG, VIEW_TAG_PREFIX, ui_url

    tr = Tracker(None, TASK, GPU)
    tags = tr.client.get_experiment(tr.experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == "custom_model_development"  # not MLflow 3's GenAI view
    view = json.loads(tags[VIEW_TAG])
    for col in (
        "metrics.`latency_ms`",
        "metrics.`sol_fraction`",
        "metrics.`speedup_vs_baseline`",
        "tags.`kernelarc.verdict`",
    ):
        assert col in view["selectedColumns"]
    cands = json.loads(tags[VIEW_TAG_PREFIX + CANDIDATES_VIEW_KEY])
    assert cands["orderByKey"] == "metrics.`latency_ms`" and "kernelarc.candidate_id" in cands["searchFilter"]
    # The candidates view's filter is one MLflow's search accepts, and it keeps candidates only.
    pid = tr.start_session({})
    cand = make_candidate()
    child = tr.log_candidate(cand, make_verdict(cand))
    found = tr.client.search_runs([tr.experiment_id], filter_string=cands["searchFilter"])
    assert [r.info.run_id for r in found] == [child] and pid != child
    url = ui_url(tr.experiment_id)
    assert url.endswith(
        f"/#/experiments/{tr.experiment_id}/runs?workflowType=machine_learning&viewStateShareKey=kernelarc"
    )
    # A store made before the tags existed is fixed when a tracker opens it.
    tr.client.set_experiment_tag(tr.experiment_id, EXPERIMENT_KIND_TAG, "genai_development")
    tr.client.delete_experiment_tag(tr.experiment_id, VIEW_TAG)
    Tracker(None, TASK, GPU)
    tags = tr.client.get_experiment(tr.experiment_id).tags
    assert tags[EXPERIMENT_KIND_TAG] == "custom_model_development" and VIEW_TAG in tags


def test_session_run_names_say_what_a_sweep_varies():
    from kernelarc.tracking import session_run_name

    assert session_run_name("rmsnorm", "cpu", 4, 16) == "rmsnorm-cpu-4a-m16"
    assert session_run_name("rmsnorm", "h200", 1, None) == "rmsnorm-h200-1a-mall"
    assert session_run_name("matmul", "h200", 2, 0, backend="anthropic", seed=3) == "matmul-h200-2a-m0-anthropic-s3"


def test_child_run_duration_is_the_evaluation(workdir):
    tr = Tracker(None, TASK, GPU)
    tr.start_session({})
    cand = make_candidate()
    run = tr.client.get_run(tr.log_candidate(cand, make_verdict(cand), started=1_700_000_000.25, ended=1_700_000_004.5))
    assert (run.info.start_time, run.info.end_time) == (1_700_000_000_250, 1_700_000_004_500)
    assert tr.client.get_metric_history(run.info.run_id, "latency_ms")[0].timestamp == 1_700_000_004_500
    # Without explicit times: ends now, started eval_seconds (3.2 s) earlier.
    cand2 = make_candidate(2)
    run2 = tr.client.get_run(tr.log_candidate(cand2, make_verdict(cand2)))
    assert run2.info.end_time - run2.info.start_time == 3200


def test_summary_is_logged_at_the_last_step_so_series_stay_monotone(workdir):
    tr = Tracker(None, TASK, GPU)
    pid = tr.start_session({})
    for step in range(1, 6):
        tr.log_session_metrics(step, evaluated=step)
    tr.end_session(summary={"evaluated": 5})
    history = sorted(tr.client.get_metric_history(pid, "evaluated"), key=lambda m: (m.step, m.timestamp))
    values = [m.value for m in history]
    assert values == sorted(values) and history[-1].step == 5 and history[-1].value == 5
    # A resumed session continues the series from its last step.
    tr2 = Tracker(None, TASK, GPU)
    tr2.start_session({}, resume_run_id=pid)
    tr2.end_session(summary={"evaluated": 5})
    assert min(m.step for m in tr.client.get_metric_history(pid, "evaluated")) == 1


def test_best_so_far_plot_shows_every_candidate_and_the_champion_staircase(workdir):
    pytest.importorskip("matplotlib")
    from matplotlib.image import imread

    tr = Tracker(None, TASK, GPU)
    pid = tr.start_session({})
    history = [(i, 1.0 + 0.1 * (i % 5)) for i in range(30)]
    assert tr.log_best_so_far_plot(history, champions=[(0, 1.2), (7, 1.0)]) == "best_so_far.png"
    png = imread(tr.client.download_artifacts(pid, "best_so_far.png", str(workdir / "dl")))
    # Blue-ish scatter pixels (C0) for the 30 candidates and orange ones (C1) for the staircase.
    r, g, b = png[..., 0], png[..., 1], png[..., 2]
    assert ((b > 0.6) & (r < 0.5)).sum() > 200
    assert ((r > 0.9) & (g > 0.4) & (g < 0.7) & (b < 0.3)).sum() > 100
