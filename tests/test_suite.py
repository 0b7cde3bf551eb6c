"""python -m kernelarc.suite: one session per problem folder, failures as rows, resume, MLflow parent run."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kernelarc.suite import ProblemResult, ProblemStatus, find_problems, representative, select_problems, write_table

ROOT = Path(__file__).resolve().parents[1]
RMSNORM = ROOT / "kernelarc" / "tasks" / "builtin" / "rmsnorm"
ARGS = ["budget.candidates=2", "guard.compile_baseline=false", "agents.count=2", "executor.parallel=1",
        "guard.target_ms=5", "guard.max_iters=20", "guard.seeds=2"]  # fmt: skip


def _problem(root: Path, folder: str, name: str, reference: str) -> Path:
    d = json.loads((RMSNORM / "definition.json").read_text())
    p = root / folder
    p.mkdir(parents=True)
    (p / "definition.json").write_text(json.dumps(dict(d, name=name, reference=reference)))
    wl = {
        "uuid": f"{name}-0",
        "axes": {"M": 8, "N": 64},
        "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}},
    }
    (p / "workload.jsonl").write_text(json.dumps(wl) + "\n")
    return p


def _tree(root: Path) -> Path:
    """Three tiny problems: rmsnorm (the built-in families apply), a reference that raises when
    run, a reference that fails at import; plus a folder that is not a problem."""
    ref = json.loads((RMSNORM / "definition.json").read_text())["reference"]
    _problem(root, "L1/001_rmsnorm", "rmsnorm", ref)
    _problem(
        root, "L1/002_broken", "broken_ref", "import torch\n\ndef run(x, weight):\n    raise RuntimeError('boom')\n"
    )
    _problem(root, "L2/003_import", "import_ref", "import torch\nraise ImportError('no lib')\n\ndef run(x, weight):\n"
             "    return x\n")  # fmt: skip
    (root / "notes").mkdir()
    (root / "notes" / "README.md").write_text("not a problem")
    return root


def _suite(cwd: Path, tree: Path, *extra: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "kernelarc.suite", f"dir={tree}", *ARGS, *extra]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def test_problem_discovery_filter_and_representative_workloads(tmp_path):
    tree = _tree(tmp_path / "tree")
    found = find_problems(tree)
    assert [str(p.relative_to(tree)) for p in found] == ["L1/001_rmsnorm", "L1/002_broken", "L2/003_import"]
    assert select_problems(tree, found, ["002_broken", "L2/003_import"]) == found[1:]
    with pytest.raises(ValueError, match="nope"):
        select_problems(tree, found, ["nope"])
    sizes = {0: 50, 1: 10, 2: 40, 3: 20, 4: 30}
    assert representative(list(sizes), 2, sizes.get) == [0, 1]  # smallest and largest
    assert representative(list(sizes), 3, sizes.get) == [0, 1, 4]  # ... and the median
    assert representative(list(sizes), 1, sizes.get) == [4]
    assert representative(list(sizes), None, sizes.get) == [0, 1, 2, 3, 4]


def test_table_round_trips_with_harness_columns(tmp_path):
    rows = [ProblemResult(problem="a", status=ProblemStatus.improved, speedup_vs_reference=1.5, workloads=[0, 3],
                          workloads_not_run={3: "above the cap"}),
            ProblemResult(problem="b", status=ProblemStatus.failed, reason="the reference raises")]  # fmt: skip
    jpath, cpath = write_table(rows, tmp_path)
    assert [ProblemResult.model_validate(r) for r in json.loads(jpath.read_text())] == rows
    header = cpath.read_text().splitlines()[0].split(",")
    assert header[:3] == ["problem", "definition", "status"] and "harness_verdict" in header
    assert '"{""3"": ""above the cap""}"' in cpath.read_text()  # a dict cell as JSON, as a list's is


def test_the_table_says_how_far_the_timings_could_be_trusted():
    from kernelarc.suite import render_table, result_from_summary

    summary = {"status": "finished", "champion_agent": "tiling", "champion_family": "rmsnorm.rowblock",
               "verdicts": 9, "void_comparisons": 2, "timed_again": 3}  # fmt: skip
    r = result_from_summary("L1/001_x", summary, [0])
    assert (r.verdicts, r.void_comparisons, r.timed_again) == (9, 2, 3)
    old = result_from_summary("L1/002_y", {"status": "finished"}, [0])  # a summary from before the counts
    assert (old.verdicts, old.void_comparisons, old.timed_again) == (0, 0, 0)
    text = render_table([r, old])
    assert "timing: 2 of 9 verdicts void" in text and "3 workload timings done again" in text


def test_the_table_says_which_built_champions_are_behind_torch_compile():
    """On the H200 (L1/085, L1/087): a KernelArc kernel crowned while torch.compile was still compiling, then
    torch.compile measured after the budget 1.01x and 1.16x faster. The row's status is baseline and the
    built count says how many such champions it holds."""
    from kernelarc.suite import render_table, result_from_summary

    ahead = {"status": "finished", "champion_agent": "fusion", "champion_family": "composed.x.fused.rowblock",
             "speedup_vs_compile": 1.4}  # fmt: skip
    behind = dict(ahead, speedup_vs_compile=1.08, speedup_vs_compile_drift_corrected=0.86)
    rows = [result_from_summary("L1/001_a", ahead, [0]), result_from_summary("L1/002_b", behind, [0])]
    assert [r.status.value for r in rows] == ["improved", "baseline"]
    text = render_table(rows)
    assert "a KernelArc-built champion on 2 of 2 (1 of them behind torch.compile)" in text
    assert "behind" not in render_table(rows[:1])


def test_bad_suite_usage_is_exit_2(tmp_path):
    r = _suite(tmp_path, tmp_path / "missing")
    assert r.returncode == 2 and "not a folder" in r.stderr
    r = _suite(tmp_path, _tree(tmp_path / "tree"), "budget.candidates=0")
    assert r.returncode == 2 and "budget.candidates" in r.stderr


@pytest.mark.slow
def test_suite_runs_every_problem_records_failures_and_resumes(tmp_path):
    tree = _tree(tmp_path / "tree")
    r = _suite(tmp_path, tree)
    assert r.returncode == 0, r.stderr[-3000:]
    tables = list((tmp_path / ".kernelarc" / "suite" / "cpu").glob("*/table.json"))
    assert len(tables) == 1
    rows = {row["problem"]: row for row in json.loads(tables[0].read_text())}
    assert set(rows) == {"L1/001_rmsnorm", "L1/002_broken", "L2/003_import"}
    good = rows["L1/001_rmsnorm"]
    assert good["status"] in ("improved", "baseline") and good["evaluated"] == 2, good
    assert good["champion_family"] and good["mlflow_run_id"] and good["speedup_vs_reference"] >= 1.0
    broken = rows["L1/002_broken"]
    assert broken["status"] == "failed" and "reference failed" in broken["reason"] and "boom" in broken["reason"]
    imp = rows["L2/003_import"]
    assert imp["status"] == "failed" and "does not import" in imp["reason"] and "no lib" in imp["reason"]
    assert (tables[0].parent / "table.csv").is_file()
    assert "a KernelArc-built champion on " in r.stdout and " of 3; x torch.compile known on 0" in r.stdout

    from mlflow import MlflowClient

    c = MlflowClient(tracking_uri=f"sqlite:///{tmp_path}/mlflow.db")
    suite_exp = c.get_experiment_by_name("kernelarc/suite/cpu")
    (suite_run,) = c.search_runs([suite_exp.experiment_id])
    assert suite_run.info.status == "FINISHED"
    assert suite_run.data.metrics["problems_failed"] == 2
    built = good["champion_family"] not in ("reference", "torch.compile", "pytorch.compile_variants")
    assert suite_run.data.metrics["problems_kernelarc_built"] == int(built)
    assert suite_run.data.metrics["problems_with_compile_figure"] == 0  # the suite runs without torch.compile
    assert suite_run.data.tags["kernelarc.problem.L1_001_rmsnorm"].endswith(good["mlflow_run_id"])
    # failed sessions are FAILED runs with their reason as a tag
    for name, row in (("broken_ref", broken), ("import_ref", imp)):
        runs = c.search_runs([c.get_experiment_by_name(f"kernelarc/{name}/cpu").experiment_id])
        (run,) = [x for x in runs if not x.data.tags.get("mlflow.parentRunId")]
        assert run.info.status == "FAILED" and run.info.run_id == row["mlflow_run_id"]
        assert run.data.tags["kernelarc.failure_reason"] == row["reason"]
    rms_exp = c.get_experiment_by_name("kernelarc/rmsnorm/cpu").experiment_id
    sessions_before = [x for x in c.search_runs([rms_exp]) if not x.data.tags.get("mlflow.parentRunId")]

    # Same command again: every problem is read from its saved result, nothing runs.
    r2 = _suite(tmp_path, tree)
    assert r2.returncode == 0, r2.stderr[-3000:]
    assert r2.stdout.count("[saved result]") == 3
    # A kill after a session ended but before its result was saved: only that problem runs, and
    # its session resumes (same parent run, nothing measured again).
    (result,) = tables[0].parent.glob("results/L1_001_rmsnorm.json")
    result.unlink()
    r3 = _suite(tmp_path, tree, "suite.problems=[L1/001_rmsnorm]")
    assert r3.returncode == 0, r3.stderr[-3000:]
    again = json.loads(result.read_text())
    assert again["mlflow_run_id"] == good["mlflow_run_id"] and again["evaluated"] == 2
    sessions_after = [x for x in c.search_runs([rms_exp]) if not x.data.tags.get("mlflow.parentRunId")]
    assert len(sessions_after) == len(sessions_before) == 1


def test_harness_eval_reads_nvidias_trace_format():
    """scripts/harness_eval.py parses what NVIDIA's CLI prints with --json: Trace objects built with
    the harness's own model, mixed with non-JSON lines."""
    harness = ROOT.parent / "shared" / "sol-execbench-harness" / "src"
    if not (harness / "sol_execbench" / "core" / "data" / "trace.py").is_file():
        pytest.skip(f"NVIDIA's harness is not at {harness}")
    sys.path.insert(0, str(harness))
    try:
        from sol_execbench.core.data.trace import Correctness, Environment, Evaluation, Performance, Trace
        from sol_execbench.core.data.workload import Workload
    except ImportError as e:
        pytest.skip(f"NVIDIA's trace model does not import here: {e}")
    finally:
        sys.path.remove(str(harness))
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import harness_eval
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    wl = Workload.model_validate({"uuid": "w", "axes": {"M": 8}, "inputs": {}})
    env = Environment(hardware="H200")

    def trace(status: str, speedup: float | None = None) -> str:
        perf = None
        if speedup:
            perf = Performance(latency_ms=0.1, reference_latency_ms=0.1 * speedup, speedup_factor=speedup)
        corr = Correctness() if status in ("PASSED", "INCORRECT_NUMERICAL") else None
        ev = Evaluation(status=status, environment=env, timestamp="t", correctness=corr, performance=perf)
        return json.dumps(Trace(definition="d", workload=wl, solution="s", evaluation=ev).model_dump(mode="json"))

    out = "\n".join(["Problem: d", trace("PASSED", 2.0), trace("PASSED", 8.0), "noise {not json"])
    assert harness_eval.summarize(harness_eval.parse_traces(out)) == ("PASSED", "2/2", pytest.approx(4.0))
    out = "\n".join([trace("PASSED", 2.0), trace("INCORRECT_NUMERICAL"), trace("INCORRECT_NUMERICAL")])
    verdict, passed, speedup = harness_eval.summarize(harness_eval.parse_traces(out))
    assert (verdict, passed, speedup) == ("INCORRECT_NUMERICAL", "1/3", pytest.approx(2.0))


def test_concurrent_suites_share_one_queue_through_claims(tmp_path):
    """Two suite processes over the same problems and one claims folder: every problem runs exactly
    once, in one of the two tables (shards on one GPU take problems from one queue)."""
    tree = tmp_path / "tree"
    for k in range(4):  # references that fail fast: the test is about the queue, not the search
        _problem(
            tree, f"L1/00{k}_broken", f"broken{k}", "import torch\n\ndef run(x, weight):\n    raise RuntimeError('x')\n"
        )
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kernelarc.suite",
                f"dir={tree}",
                *ARGS,
                f"suite.out=.kernelarc/shard{k}",
                f"suite.claims={tmp_path / 'claims'}",
                f"tracking.uri=sqlite:///{tmp_path}/shard{k}.db",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        for k in range(2)
    ]
    for p in procs:
        _out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-3000:]
    seen: list[str] = []
    for k in range(2):
        for t in (tmp_path / f".kernelarc/shard{k}").glob("*/*/table.json"):
            seen += [row["problem"] for row in json.loads(t.read_text())]
    assert sorted(seen) == [f"L1/00{k}_broken" for k in range(4)]
    assert len(list((tmp_path / "claims").glob("*.claim"))) == 4


@pytest.mark.slow
def test_a_reference_too_slow_for_the_budget_is_a_failed_row_on_time(tmp_path):
    """L1/094 on the H200: a reference that takes seconds per call never finished its own evaluation
    and the shard was killed with no row. Now the reference's measurement ends at guard.baseline_timeout_s
    (it does not count against budget.minutes), with a reason that says which key to raise."""
    ref = json.loads((RMSNORM / "definition.json").read_text())["reference"]
    slow = ref.replace("import torch\n", "import time\n\nimport torch\n", 1).replace(
        "def run(x, weight):\n", "def run(x, weight):\n    time.sleep(1.0)\n", 1
    )
    assert "time.sleep(1.0)" in slow
    tree = tmp_path / "tree"
    _problem(tree, "L1/001_slow", "slow_ref", slow)
    timeout_s = 4
    r = _suite(tmp_path, tree, "budget.minutes=0.02", f"guard.timeout_s={timeout_s}",
               f"guard.baseline_timeout_s={timeout_s}", timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    (row,) = json.loads(next((tmp_path / ".kernelarc").rglob("table.json")).read_text())
    assert row["status"] == "failed", row
    assert "(timeout)" in row["reason"] and "guard.baseline_timeout_s=4: raise it" in row["reason"], row["reason"]


def test_the_reference_under_other_compile_settings_is_not_kernelarc_built():
    from kernelarc.agents.search import GENERIC_FAMILY
    from kernelarc.suite import NOT_BUILT, ProblemResult, is_kernelarc_built

    assert GENERIC_FAMILY in NOT_BUILT  # one name for the generic family in both places
    row = {"problem": "L1/x", "status": "improved", "evaluated": 3}
    assert not is_kernelarc_built(ProblemResult(**row, champion_family=GENERIC_FAMILY))
    assert not is_kernelarc_built(ProblemResult(**row, champion_family="torch.compile"))
    assert is_kernelarc_built(ProblemResult(**row, champion_family="composed.x.rmsnorm.rowblock"))


def test_a_dispatch_between_baselines_is_not_kernelarc_built():
    """A shape dispatch counts as KernelArc-built only with a part KernelArc built (L2/008 on the H200: a
    dispatch of the reference and torch.compile was counted as built)."""
    from kernelarc.suite import ProblemResult, is_kernelarc_built

    row = {"problem": "L2/x", "status": "improved", "evaluated": 3, "champion_family": "dispatch"}
    assert not is_kernelarc_built(ProblemResult(**row, champion_parts=["reference", "torch.compile"]))
    assert not is_kernelarc_built(ProblemResult(**row, champion_parts=["pytorch.compile_variants", "unknown"]))
    assert is_kernelarc_built(ProblemResult(**row, champion_parts=["composed.x.rmsnorm.rowblock", "torch.compile"]))
    assert is_kernelarc_built(ProblemResult(**row))  # a row saved before parts were recorded: as before


def _wait_for(pred, seconds: float, proc: subprocess.Popen) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end and proc.poll() is None:
        if pred():
            return True
        time.sleep(0.2)
    return False


def _stop_after_first_candidate(tmp_path: Path, *extra: str) -> tuple[list[str], dict, subprocess.Popen, str]:
    """A suite over one rmsnorm problem, stopped by SIGTERM once its session has judged a candidate: the command,
    the environment, the finished process and its stderr."""
    tree = tmp_path / "tree"
    ref = json.loads((RMSNORM / "definition.json").read_text())["reference"]
    _problem(tree, "L1/001_rmsnorm", "rmsnorm", ref)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "kernelarc.suite", f"dir={tree}", *ARGS, "budget.candidates=40", "budget.minutes=1",
           *extra]  # fmt: skip
    evals = lambda: list((tmp_path / ".kernelarc").glob("rmsnorm/*/*/evaluations.jsonl"))  # noqa: E731
    judged = lambda: any('"kind": "candidate"' in f.read_text() for f in evals())  # noqa: E731
    with subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as p:
        started = _wait_for(judged, 300, p)
        if started:
            p.send_signal(signal.SIGTERM)
        _out, err = p.communicate(timeout=120)
    assert started, f"no candidate judged before the suite ended (rc {p.returncode}): {err[-2000:]}"
    assert p.returncode == 128 + signal.SIGTERM, err[-3000:]
    assert "suite stopped by SIGTERM" in err
    return cmd, env, p, err


def _stopped_row(tmp_path: Path) -> tuple[Path, dict]:
    (table,) = (tmp_path / ".kernelarc" / "suite" / "cpu").glob("*/table.json")
    (row,) = json.loads(table.read_text())
    assert row["stopped"] and row["problem"] == "L1/001_rmsnorm", row
    assert row["reason"].startswith("stopped by SIGTERM while it ran"), row["reason"]
    assert row["status"] in ("improved", "baseline") and row["champion_family"] and row["evaluated"] >= 1, row
    assert row["speedup_vs_reference"] and row["mlflow_run_id"], row
    return table, row


@pytest.mark.slow
def test_a_stopped_suite_in_process_isolation_saves_the_row_its_child_saved(tmp_path):
    """suite.isolation=process: the child runs in its own process group, out of the stop's reach; the suite passes
    the stop on, the child saves its row, and the suite records it. No process is left behind."""
    _cmd, _env, p, _err = _stop_after_first_candidate(tmp_path, "suite.isolation=process")
    _stopped_row(tmp_path)
    left = subprocess.run(["pgrep", "-f", f"dir={tmp_path / 'tree'}"], capture_output=True, text=True).stdout.split()
    assert not left, left


@pytest.mark.slow
def test_a_stopped_suite_saves_the_running_problems_row_and_runs_it_again(tmp_path):
    """L1/094 on the H200: its session had crowned a recurrence kernel 1,500x faster than the reference when the
    suite's time limit (``timeout``) stopped it during torch.compile after the budget; the shard had no table and the
    problem no row. A SIGTERM now saves the running problem's row from what its session judged so far (stopped), and
    the same command runs that problem again from its session state."""
    cmd, env, _p, _err = _stop_after_first_candidate(tmp_path)
    table, row = _stopped_row(tmp_path)

    # The same command: the problem runs again from its session state (same session run, the candidates judged
    # before the stop are not judged again) and its row is final.
    r = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[saved result]" not in r.stdout
    (again,) = json.loads(table.read_text())
    assert not again["stopped"] and again["mlflow_run_id"] == row["mlflow_run_id"], again
    assert again["evaluated"] >= row["evaluated"] and again["reason"] is None, again


def test_the_row_reads_torch_compile_as_timed_side_by_side():
    """Quant/014 on the H200: the champion was crowned at a slow 0.125 ms and timed 0.07 / 0.0096 ms beside every
    later challenger, with torch.compile 1.88x slower beside it; the ratio of the two medians, measured minutes
    apart, read 0.46x and the row called a built champion the guard had kept over torch.compile 'baseline'."""
    from kernelarc.suite import result_from_summary

    summary = {"champion": "c1", "champion_agent": "fusion", "champion_family": "composed.x.library",
               "speedup_vs_compile": 0.46, "speedup_vs_compile_drift_corrected": 1.88}  # fmt: skip
    assert result_from_summary("Quant/014", summary, None).status is ProblemStatus.improved
    slower = dict(summary, speedup_vs_compile=1.2, speedup_vs_compile_drift_corrected=0.8)
    assert result_from_summary("Quant/014", slower, None).status is ProblemStatus.baseline
    alone = dict(summary, speedup_vs_compile=0.9, speedup_vs_compile_drift_corrected=None)
    assert result_from_summary("Quant/014", alone, None).status is ProblemStatus.baseline
    # a stop before anything was crowned is no result, and says why; the notes of the baselines follow the reason
    stopped = {"champion": None, "champion_agent": None, "stopped": True, "reason": "stopped by SIGTERM while it ran",
               "baseline_notes": {"torch.compile": "not measured"}}  # fmt: skip
    row = result_from_summary("L1/094", stopped, None)
    assert row.status is ProblemStatus.failed and row.stopped
    assert row.reason == "stopped by SIGTERM while it ran; torch.compile: not measured"


class _Stop(BaseException):
    pass


def test_a_stop_between_the_logged_record_and_its_application_sees_the_record(tmp_path):
    """CI: the stop test sent SIGTERM as soon as the first candidate's record was in the state log, the handler ran
    while the session was between the log's fsync and applying the record in memory, and the row said 0 judged and
    the reference champion, one judgement behind the log the resumed run reads. The row is now read after the
    records the log holds are applied."""
    from test_compile_beside import _build

    from kernelarc.models import Status

    s, _guards = _build(tmp_path, 2.0)
    rows: list[dict] = []
    append = s.state.append

    def append_then_stop(rec):
        append(rec)
        if rec.kind == "candidate" and not rows:
            rows.append(s.summary_so_far("stopped by SIGTERM while it ran"))
            raise _Stop  # the handler raises; the session does not apply the record again

    s.state.append = append_then_stop
    with pytest.raises(_Stop):
        s.run()
    (row,) = rows
    assert row["stopped"] and row["evaluated"] == 1, row
    logged = s.state.load()
    first = next(i for i, r in enumerate(logged) if r.kind == "candidate")
    # the same champion the log's records up to that candidate crown, and nothing applied twice
    crowned = [r.candidate.id for r in logged[: first + 1] if r.verdict.status is Status.champion]
    assert row["champion"] == crowned[-1], (row["champion"], crowned)
    assert [r.candidate.id for r in s.records] == [r.candidate.id for r in logged]


def test_suite_merge_joins_the_calls_of_one_suite(tmp_path, capsys):
    """scripts/suite_merge.py: the suite over all 45 takes several device calls. A later call's row replaces an
    earlier one's, except that a row stopped by its call's end never replaces a finished one; issue 14's
    measures count a problem without a torch.compile figure as 1.0 and a built champion behind it on either
    ratio (or stopped) as not counted."""
    from kernelarc.suite import result_from_summary

    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import suite_merge
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    built = {"status": "finished", "champion_agent": "fusion", "champion_family": "composed.x.fused.rowblock"}

    def row(problem, **kw):
        return result_from_summary(problem, dict(built, **kw), [0]).model_dump(mode="json")

    first = [row("L1/001_a", speedup_vs_compile=2.0), row("L1/002_b", speedup_vs_compile=0.5),
             row("L2/003_c", speedup_vs_compile=4.0)]  # fmt: skip
    later = [row("L1/002_b", speedup_vs_compile=1.25, speedup_vs_compile_drift_corrected=0.9),
             dict(row("L2/003_c", speedup_vs_compile=9.0), stopped=True),
             {"problem": "L2/004_d", "status": "baseline", "champion_family": "reference"}]  # fmt: skip
    (tmp_path / "a.json").write_text(json.dumps(first))
    (tmp_path / "b.json").write_text(json.dumps(later))
    merged = suite_merge.merge([("A", first), ("B", later)])
    assert [(label, r.problem) for label, r in merged] == [("A", "L1/001_a"), ("B", "L1/002_b"), ("A", "L2/003_c"),
                                                          ("B", "L2/004_d")]  # fmt: skip
    assert [suite_merge.not_behind(r) for _, r in merged] == [True, False, True, False]
    assert suite_merge.main([f"A={tmp_path / 'a.json'}", f"B={tmp_path / 'b.json'}"]) == 0
    out = capsys.readouterr().out
    assert "built and not behind torch.compile on either ratio, finished: 2 of 4" in out
    # (2.0 * 1.25 * 4.0 * 1.0) ** (1 / 4)
    assert "geomean x torch.compile over all 4 (1.0 where none was measured): 1.78" in out
    assert "| L1 002 | B | **composed fused.rowblock** | yes | 1.25 (0.90) |" in out
    with pytest.raises(SystemExit) as e:
        suite_merge.main([str(tmp_path / "a.json")])
    assert e.value.code == 2
    # a later crash never replaces a row that ran (an earlier call's crash is replaced by any later row)
    crashed = {"problem": "L1/001_a", "status": "crashed", "reason": "boom"}
    again = suite_merge.merge([("A", first), ("C", [crashed, dict(crashed, problem="L2/005_e")]),
                               ("D", [row("L2/005_e", speedup_vs_compile=1.5)])])  # fmt: skip
    assert [(label, r.problem) for label, r in again if r.problem in ("L1/001_a", "L2/005_e")] == [
        ("A", "L1/001_a"), ("D", "L2/005_e")]  # fmt: skip


def test_a_cut_call_collects_its_shards_rows_by_the_merge_rule(tmp_path, monkeypatch, capsys):
    """scripts/gpu_suite.sh's rows when its call is cut (run DW: no shard table came back): every shard's
    table.json and, where a shard was killed before writing it, its result files; ranked as suite_merge ranks
    the rows of several calls, and without importing torch."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import suite_merge
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    state = tmp_path / ".kernelarc"
    one, two = state / "suite_shard0" / "h100" / "a1", state / "suite_shard1" / "h100" / "b2"
    (one / "results").mkdir(parents=True)
    (two / "results").mkdir(parents=True)
    fin = {"problem": "L1/001_a", "status": "improved", "stopped": False}
    (one / "results" / "a.json").write_text(json.dumps(dict(fin, stopped=True)))  # saved when the stop came
    (one / "table.json").write_text(json.dumps([fin, {"problem": "L1/002_b", "status": "crashed"}]))
    (two / "results" / "b.json").write_text(json.dumps({"problem": "L1/002_b", "status": "baseline", "stopped": True}))
    (two / "results" / "c.json").write_text(json.dumps({"problem": "L2/003_c", "status": "baseline"}))
    (two / "table.json").write_text("{not json")
    monkeypatch.chdir(tmp_path)
    assert suite_merge.main(["--collect", str(tmp_path)]) == 0
    assert "unreadable" in capsys.readouterr().out
    rows = json.loads((tmp_path / "suite_table.json").read_text())
    assert [(r["problem"], r["status"], r.get("stopped")) for r in rows] == [
        ("L1/001_a", "improved", False), ("L1/002_b", "baseline", True), ("L2/003_c", "baseline", None)]  # fmt: skip
    (tmp_path / "suite_table.json").unlink()
    probe = (
        "import runpy, sys\n"
        f"sys.argv = ['suite_merge.py', '--collect', {str(tmp_path)!r}]\n"
        "try:\n"
        f"    runpy.run_path({str(ROOT / 'scripts' / 'suite_merge.py')!r}, run_name='__main__')\n"
        "except SystemExit as e:\n"
        "    assert not e.code, e.code\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "suite_table.json: 3 rows" in run.stdout and "torch imported: False" in run.stdout


def test_the_measured_runs_three_parts_cover_every_shared_problem_once():
    """scripts/suite_45.sh: issue 14's run over all 45 problems in three device calls (parts 1-3) or two (parts a
    and b, the same lists); a problem left out (or run twice) would only show on the device."""
    import re

    from shared_dirs import SKIP_REASON, shared_path

    tree = shared_path("sol-execbench")
    if not tree.is_dir():
        pytest.skip(SKIP_REASON)
    script = (ROOT / "scripts" / "suite_45.sh").read_text()
    lists = {k: v.split() for k, v in re.findall(r'^(LIST\d)="([^"]*)"', script, re.MULTILINE)}
    alone = sorted(set(re.findall(r'folders "(L\d/\d+)"\)', script)))  # run alone in part 3 and in part b
    part_a = script.split("\n  a)", 1)[1].split(";;", 1)[0]
    part_b = script.split("\n  b)", 1)[1].split(";;", 1)[0]
    assert "$LIST1" in part_a and "$LIST3" in part_a and "$LIST2" in part_b and alone == ["L2/024"]
    names = [*lists["LIST1"], *lists["LIST2"], *lists["LIST3"], *alone]
    problems = sorted(str(d.parent.relative_to(tree)) for d in tree.glob("*/*/definition.json"))
    assert len(names) == len(set(names)) == len(problems) == 45
    matched = sorted(next(p for p in problems if p.startswith(n + "_")) for n in names)
    assert matched == problems


def test_a_row_names_the_workloads_the_memory_plan_left_out():
    """Run DX (H100, an 11 GB share): L1/013's largest workload (17.5 GB per input set) was left out by the guard's
    memory plan, the session judged the other one, and its row gave no sign of it. The verdicts' warnings say it;
    the session's summary, the row, the table's closing lines and the merged table now do."""
    from kernelarc.models import Candidate, Status, Verdict
    from kernelarc.session_phases import workloads_not_run
    from kernelarc.state import Record
    from kernelarc.suite import render_table, result_from_summary

    why = "its inputs and outputs alone take 17.50 GB, above the cap 9.90 GB (memory cap 11.00 GB on cuda:0)"
    v = Verdict(candidate_id="c", status=Status.correct_slower, workloads_not_run={1: why},
                warnings=[f"workload 1 not run: {why}", "memory: 1 seed(s) per workload instead of 3"])  # fmt: skip
    rec = Record(-1, "baseline", Candidate(source="def run(x):\n    return x\n", language="pytorch"), v)
    assert workloads_not_run([rec, rec]) == {1: why}
    # an attempt refused under a smaller cap, then the same problem run again with the cap it needed: the figures'
    refused = Record(-1, "baseline", rec.candidate, Verdict(candidate_id="r", status=Status.runtime_error,
                                                             workloads_not_run={0: why, 1: why}))  # fmt: skip
    judged = Record(0, "baseline", rec.candidate, Verdict(candidate_id="j", status=Status.champion))
    assert workloads_not_run([refused, judged]) == {} and workloads_not_run([refused]) == {0: why, 1: why}
    built = {"status": "finished", "champion_agent": "fusion", "champion_family": "composed.x.fused.rowblock"}
    row = result_from_summary("L1/013_x", dict(built, workloads_not_run={"1": why}), [1, 8])
    assert row.workloads_not_run == {1: why}
    assert result_from_summary("L1/014_y", built, [0, 3]).workloads_not_run is None
    assert "memory: 1 judged without some of their workloads (left out by the guard's memory plan): L1/013 [1]" in (
        render_table([row])
    )
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import suite_merge
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    out = suite_merge.report(suite_merge.merge([("A", [row.model_dump(mode="json")])]))
    assert "**composed fused.rowblock (1 of 2 workloads)**" in out


def test_the_share_planner_names_what_each_share_leaves_out(tmp_path, capsys):
    """scripts/share_plan.py (how suite_45.sh's MEM_GB was chosen): on real problems, L2/024 (12 GB per input set)
    runs nothing at an 11 GB share and FlashInfer 024 runs both of its workloads with every seed."""
    import shutil

    from shared_dirs import SKIP_REASON, shared_path

    tree = shared_path("sol-execbench")
    if not tree.is_dir():
        pytest.skip(SKIP_REASON)
    for rel in ("L2/024_moe_expert_parallel_execution", "FlashInfer-Bench/024_rmsnorm_h2048"):
        shutil.copytree(tree / rel, tmp_path / rel)
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import share_plan
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    assert share_plan.main([str(tmp_path), "11"]) == 0
    lines = capsys.readouterr().out.splitlines()
    big = next(ln for ln in lines if ln.startswith("L2/024"))
    small = next(ln for ln in lines if ln.startswith("FlashInfer-Bench/024"))
    assert "11 GB: 0/2 workloads" in big and "11 GB: 2/2 workloads, 3 seeds" in small
    assert lines[-1] == "at 11 GB: 1 without a workload, 0 with fewer seeds, 0 with fewer workers"
