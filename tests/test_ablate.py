"""A small version of ``python -m kernelarc.ablate`` on the simulated guard (the real SearchSession loop)."""

import json
import math

from kernelarc.ablate import main, parse, permutation_p, summarize


def test_permutation_test_separates_clear_differences_only():
    better = [1.00, 1.01, 1.00, 1.02, 1.01, 1.00, 1.01, 1.00]
    worse = [1.10, 1.12, 1.09, 1.11, 1.13, 1.10, 1.12, 1.11]
    assert permutation_p(better, worse, rounds=2000) < 0.01
    assert permutation_p(worse, better, rounds=2000) > 0.99
    assert permutation_p(better, list(better), rounds=2000) > 0.3


def test_arguments_are_typed_and_checked():
    ab, rest = parse(["ablate.seeds=3", "ablate.memory=[0,null]", "+task=rmsnorm", "agents.per_round=1"])
    assert ab.seeds == 3 and ab.memory == [0, None] and rest == ["+task=rmsnorm", "agents.per_round=1"]
    try:
        parse(["ablate.sedes=3"])
    except SystemExit as e:
        assert "sedes" in str(e)
    else:
        raise AssertionError("a misspelt key must be refused")


def test_small_ablation_writes_table_plots_and_mlflow(tmp_path):
    out = tmp_path / "abl"
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    argv = ["ablate.seeds=2", "ablate.budget=16", "ablate.memory=[0,null]", "ablate.plateau=[true]", "ablate.jobs=1",
            f"ablate.out={out}", "ablate.mlflow=true", f"ablate.tracking_uri={uri}"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    runs, rows = doc["runs"], doc["rows"]
    assert len(runs) == 2 * 2 * 2 and all(r["evaluated"] == 16 for r in runs)
    assert {r["arm"] for r in rows} == {f"agents={a} memory={m} plateau=on" for a in (1, 4) for m in ("0", "all")}
    for r in runs:
        # the champion is the library (1.30x the optimum) or a family kernel at least as fast as the best found
        assert 1.0 <= r["ratio"] <= 1.3 + 1e-9 and len(r["curve"]) == 16
        assert r["ratio"] <= max(r["found"], 1.0) * 1.02 or r["ratio"] == 1.3
        assert all(b <= a + 1e-12 for a, b in zip(r["curve"], r["curve"][1:], strict=False))  # best so far
    for row in rows:
        p = row["p_vs_generalist"]
        assert (row["agents"] == 1 and math.isnan(p)) or 0 < p <= 1
    text = (out / "table.md").read_text()
    assert "| agents=4 memory=all plateau=on |" in text and "| 4 | on | 0 -> all | 2 |" in text
    assert {(st["agents"], st["from"], st["to"]) for st in doc["memory_steps"]} == {(1, 0, None), (4, 0, None)}
    for png in ("best_so_far.png", "memory_curve.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    import mlflow

    mlflow.set_tracking_uri(uri)
    run = mlflow.search_runs(experiment_names=["kernelarc-ablation"], output_format="list")[0]
    names = {a.path for a in mlflow.MlflowClient().list_artifacts(run.info.run_id)}
    assert {"best_so_far.png", "memory_curve.png", "table.md"} <= names
    assert any(k.startswith("agents4_memoryall") for k in run.data.metrics)


def test_summary_counts_runs_near_the_best():
    from kernelarc.ablate import RunResult

    rs = [RunResult(1, 0, True, s, x, x, [x], 8, 0, 0.1, 1.0, x) for s, x in enumerate([1.0, 1.004, 1.03, 1.2])]
    (row,) = summarize(rs)
    assert row["within_1pct"] == 2 and row["within_5pct"] == 3 and abs(row["median"] - 1.017) < 1e-9


def test_a_failed_run_costs_its_own_row_not_the_ablation(tmp_path, monkeypatch):
    import kernelarc.ablate as abl

    real = abl.run_one

    def flaky(ab, over, count, memory, plateau, seed, gpu=None):
        if count == 4 and seed == 1:
            raise RuntimeError("guard worker for cuda:0 failed to start (planted)")
        return real(ab, over, count, memory, plateau, seed, gpu)

    monkeypatch.setattr(abl, "run_one", flaky)
    out = tmp_path / "abl"
    argv = ["ablate.seeds=2", "ablate.budget=8", "ablate.memory=[16]", "ablate.plateau=[true]", "ablate.jobs=1",
            f"ablate.out={out}"]  # fmt: skip
    assert main(argv) == 0
    doc = json.loads((out / "results.json").read_text())
    assert len(doc["runs"]) == 3
    (failed,) = doc["failed_runs"]
    assert failed["arm"] == "agents=4 memory=16 plateau=on" and failed["seed"] == 1 and "planted" in failed["error"]
    assert "failed run: agents=4 memory=16 plateau=on seed 1" in (out / "table.md").read_text()


def test_a_team_without_memory_still_builds_on_its_siblings_bests():
    """memory.limit=0 hides the board's wins and traps, not the leaderboard (each agent's best kernel): in the
    real loop, before any family kernel is champion, agents already climb from points their siblings found."""
    from kernelarc.ablate import AblateConfig, run_one

    sessions: list = []
    run_one(AblateConfig(budget=16), ["+task=matmul", "agents.credit=false"], 4, 0, True, 0, sessions=sessions)
    (s,) = sessions
    assert s.settings.memory_limit == 0 and s.board.view(0) == [] and len(s.board.leaderboard()) == 4
    agent_of = {r.candidate.id: r.candidate.agent for r in s.records}
    champ = [r.index for r in s.records if r.kind == "candidate" and r.verdict.status.value == "champion"]
    cross = [r for r in s.records if r.kind == "candidate" and r.index < min(champ, default=16)
             and agent_of.get(r.candidate.parent, r.candidate.agent) != r.candidate.agent]  # fmt: skip
    assert cross, "no agent built on a sibling's point"
    # the queue is fair: each of the four agents had a quarter of the budget (agents.credit=false: even shares)
    per = [sum(r.kind == "candidate" and r.candidate.agent == a.name for r in s.records) for a in s.agents]
    assert per == [4, 4, 4, 4], per


def test_the_memory_curve_is_reported_as_paired_steps():
    from kernelarc.ablate import RunResult, memory_steps, paired_p

    assert paired_p([0.1] * 8, rounds=2000) < 0.01 and paired_p([-0.1] * 8, rounds=2000) > 0.99
    arms = lambda s: ((0, 1.2 + 0.01 * s), (16, 1.1 + 0.01 * s), (None, 1.1 + 0.01 * s))  # noqa: E731
    rs = [RunResult(4, m, True, s, x, x, [x], 8, 0, 0.1, 1.0, x) for s in range(6) for m, x in arms(s)]
    a, b = memory_steps(rs)
    assert (a["from"], a["to"], a["seeds"]) == (0, 16, 6) and abs(a["diff"] + 0.1) < 1e-9 and a["p_better"] < 0.05
    assert (b["from"], b["to"]) == (16, None) and abs(b["diff"]) < 1e-9 and b["p_worse"] > 0.5


def test_concurrent_gpu_sessions_share_the_cards_memory():
    from kernelarc.ablate import share_device_memory

    assert share_device_memory(["+task=rmsnorm"], 139.8, 10) == ["+task=rmsnorm", "guard.memory_gb=11"]
    assert share_device_memory(["guard.memory_gb=30"], 139.8, 10) == ["guard.memory_gb=30"]  # the user's choice
    assert share_device_memory([], 139.8, 1) == []  # one session per card plans for the card


def test_several_tasks_share_one_pool_and_stream_their_runs(tmp_path):
    """ablate.tasks runs every task's sessions in one pool; each run's result lands in its task's runs.jsonl as it
    ends (what a time limit that cuts the ablation leaves), and each task gets its own table."""
    out = tmp_path / "abl"
    argv = ["ablate.tasks=[matmul,rmsnorm]", "ablate.seeds=1", "ablate.budget=6", "ablate.memory=[16]",
            "ablate.plateau=[true]", "ablate.jobs=1", "ablate.max_minutes=30", f"ablate.out={out}"]  # fmt: skip
    assert main(argv) == 0
    for task in ("matmul", "rmsnorm"):
        lines = [json.loads(x) for x in (out / task / "runs.jsonl").read_text().splitlines()]
        assert sorted(r["count"] for r in lines) == [1, 4] and all(r["evaluated"] == 6 for r in lines)
        doc = json.loads((out / task / "results.json").read_text())
        assert f"+task={task}" in doc["overrides"] and len(doc["runs"]) == 2
    # a cut ablation's report: its tables again from the streamed runs, no new session
    first = (out / "matmul" / "results.json").read_text()
    (out / "matmul" / "results.json").unlink()
    (out / "rmsnorm" / "runs.jsonl").write_text((out / "rmsnorm" / "runs.jsonl").read_text().splitlines()[0] + "\n")
    assert main([*argv, "ablate.report_only=true"]) == 0
    assert json.loads((out / "matmul" / "results.json").read_text())["rows"] == json.loads(first)["rows"]
    assert len(json.loads((out / "rmsnorm" / "results.json").read_text())["runs"]) == 1
    try:
        main(["ablate.max_minutes=0", f"ablate.out={out}"])
    except ValueError as e:
        assert "max_minutes" in str(e)
    else:
        raise AssertionError("a non-positive per-run cap must be refused")
