"""Terminal output: short candidate lines, plain text off a terminal, a live bar on one, closing commands."""

from __future__ import annotations

import io

from kernelarc.models import Candidate, Status, Verdict
from kernelarc.ui import LINE_WIDTH, Progress, candidate_line, next_steps


def _cand(**kw) -> Candidate:
    knobs = {"block_n": 1024, "rows": 4, "num_warps": 8, "num_stages": 3, "persistent": 1, "x": "y" * 40}
    fields = dict(source="def run(x):\n    return x\n", language="triton", agent="agent12-scheduling-long-name",
                  strategy="scheduling", family="rmsnorm.chunked_persistent_variant", knobs=knobs)  # fmt: skip
    fields.update(kw)
    return Candidate(**fields)


def test_candidate_lines_stay_short_and_keep_what_matters():
    cand = _cand()
    ok = Verdict(candidate_id=cand.id, status=Status.champion, latency_ms=0.01234, speedup_vs_champion=1.07)
    line = candidate_line(123, 400, cand, ok, 0.02)
    assert len(line) <= LINE_WIDTH < 100
    assert (
        line.startswith("[123/400] agent12-schedu rmsnorm.chunked_persis ")
        and "★ champion" in line
        and "0.0123 ms 1.07x" in line
    )
    assert "block_n=1024" in line and line.endswith("…")
    bad = Verdict(candidate_id=cand.id, status=Status.compile_error, errors=["SyntaxError: " + "z" * 300 + "\nmore"])
    line = candidate_line(7, 40, cand, bad, None)
    assert len(line) <= LINE_WIDTH and "✗ compile" in line and "SyntaxError: zzz" in line and "more" not in line


def test_plain_output_off_a_terminal_counts_plateaus_and_ends_with_commands():
    out = io.StringIO()
    ui = Progress(True, stream=out)
    assert not ui.live  # a StringIO is no terminal: plain lines, no bar
    cand = _cand()
    ui.candidate(1, 10, cand, Verdict(candidate_id=cand.id, status=Status.incorrect), None)
    ui.line("  ⟳ plateau: try the persistent family")
    ui.summary([("task", "rmsnorm"), ("latency_ms", 0.123456)], [("open the MLflow UI", "mlflow ui ...")])
    text = out.getvalue()
    assert ui.plateaus == 1 and ui.counts[Status.incorrect] == 1
    assert "latency_ms  0.1235" in text and text.rstrip().endswith("open the MLflow UI:\n  mlflow ui ...")
    assert "\x1b[" not in text  # no terminal escapes in logs


def test_live_bar_on_a_terminal():
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Tty()
    ui = Progress(True, stream=out)
    assert ui.live
    cand = _cand()
    ui.candidate(1, 4, cand, Verdict(candidate_id=cand.id, status=Status.champion, latency_ms=0.5), 0.5)
    assert ui._bar is not None and "champion 0.5 ms" in ui._status() and "★1" in ui._status()
    ui.summary([("task", "rmsnorm")], [("export the champion", "python -m kernelarc.export ...")])
    assert ui._bar is None and "python -m kernelarc.export" in out.getvalue()


def test_next_steps_name_the_store_and_the_task():
    from kernelarc.config import KernelArcConfig

    cfg = KernelArcConfig()
    cfg.task.name = "rmsnorm"
    steps = dict(next_steps(cfg, {"gpu": "h200", "registry_version": 3}, "7"))
    assert steps["open the MLflow UI"].startswith("mlflow ui --backend-store-uri sqlite:///")
    assert (
        "#/experiments/7/runs?workflowType=machine_learning&viewStateShareKey=kernelarc" in steps["open the MLflow UI"]
    )
    assert (
        steps["export the champion"]
        == "python -m kernelarc.export +task=rmsnorm gpu=h200 format=sol-execbench out=exported"
    )
    assert "export the champion" not in dict(next_steps(cfg, {"gpu": "h200", "registry_version": None}, "7"))
