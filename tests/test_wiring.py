"""The wiring (kernelarc.wiring): a session built from the config once, the task loaded once, one guard
settings type whose config keys (and so MLflow params) are exactly the ``guard.*`` contract."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from kernelarc import wiring
from kernelarc.app import typed
from kernelarc.config import plain, register_configs
from kernelarc.guard.settings import GuardSettings
from kernelarc.hardware import resolve_target
from kernelarc.simguard import simulated_guard_factory
from kernelarc.ui import Progress

CONF = Path(__file__).resolve().parents[1] / "conf"

# The guard.* keys of the composed config: the parent run's params (DESIGN.md's tracking contract).
GUARD_KEYS = {
    "seeds", "seed_pool", "timeout_s", "baseline_timeout_s", "build_timeout_s", "compile_timeout_s", "warmup_ms",
    "target_ms",
    "min_iters", "max_iters", "flush_mb", "min_gain", "noise_factor", "consistency", "hp_reference",
    "compile_baseline", "compile_after_budget", "prove_vs_compile", "warmup_lock_s", "bench_lock_s", "memory_gb",
}  # fmt: skip


def _cfg(tmp_path: Path, *extra: str):
    register_configs()
    over = ["+task=matmul", "gpu=cpu", "agents.backend=search", "tracking.enabled=false", "search.calibrate=false",
            "search.progress=false", f"search.state_dir={tmp_path}/state", *extra]  # fmt: skip
    with initialize_config_dir(config_dir=str(CONF), version_base=None):
        return compose("config", overrides=over)


def test_guard_keys_are_the_contract_and_derived_fields_are_not_keys(tmp_path):
    cfg = _cfg(tmp_path)
    assert set(plain(cfg)["guard"]) == GUARD_KEYS
    for internal in ("prestart", "workloads", "rounds", "flush_bytes"):
        with pytest.raises(Exception, match=internal):
            _cfg(tmp_path, f"guard.{internal}=1")
    c = typed(_cfg(tmp_path, "executor.prestart=1", "guard.flush_mb=16"))
    assert isinstance(c.guard, GuardSettings) and c.guard.consistency is None
    task = wiring.load_task_from_config(c, True)
    cpu = wiring.guard_settings(c, task, True)
    assert (cpu.consistency, cpu.prestart, cpu.flush_bytes) == (4.0, 1, 16 << 20)
    assert cpu.workloads and all(task.io_bytes(i) <= 64 << 20 for i in cpu.workloads)
    gpu = wiring.guard_settings(c, task, False)
    assert (gpu.consistency, gpu.workloads) == (1.5, None)
    c2 = typed(_cfg(tmp_path, "guard.consistency=2.5", "task.workloads=[0]"))
    given = wiring.guard_settings(c2, task, True)
    assert (given.consistency, given.workloads) == (2.5, [0])
    assert GuardSettings().consistency_factor == 1.5  # a Guard built without the wiring: the GPU's factor


def test_session_is_built_once_with_one_task_and_runs(tmp_path, monkeypatch):
    fits = []
    real = wiring.fit_workloads
    monkeypatch.setattr(wiring, "fit_workloads", lambda t: fits.append(t.name) or real(t))
    cfg = _cfg(tmp_path, "agents.count=2", "budget.candidates=6")
    c = typed(cfg)
    session = wiring.build_session(c, plain(cfg), resolve_target("cpu"), progress=Progress(False),
                                   make_guard=simulated_guard_factory(0))  # fmt: skip
    assert fits == ["matmul"]  # the CPU fit (and its reference check) ran once, for agents and guards alike
    assert all(a.task is session.task for a in session.agents) and session.guards[0].task is session.task
    assert not hasattr(session, "cfg") and session.settings.candidates == 6
    assert session.settings.guard == wiring.guard_settings(c, session.task, True)
    summary = session.run()
    assert summary["evaluated"] == 6 and summary["status"] == "finished"
    assert len([r for r in session.records if r.kind == "candidate"]) == 6
    assert session.board.view(None), "the board sink posted the agents' findings"
    assert (Path(summary["state_dir"]) / "evaluations.jsonl").is_file()


def test_ablation_arms_differ_only_in_config(tmp_path):
    built = []
    for memory in ("0", "null"):
        cfg = _cfg(tmp_path / memory, f"memory.limit={memory}")
        s = wiring.build_session(typed(cfg), plain(cfg), resolve_target("cpu"), progress=Progress(False),
                                 make_guard=simulated_guard_factory(0))  # fmt: skip
        built.append(dataclasses.asdict(s.settings))
        for g in s.guards:
            g.close()
    diff = {k for k in built[0] if built[0][k] != built[1][k]}
    assert diff == {"memory_limit"} and (built[0]["memory_limit"], built[1]["memory_limit"]) == (0, None)


def test_a_stop_during_the_references_import_is_not_the_references_failure(tmp_path):
    """A reference may raise anything at import (SystemExit too) and is then the session's recorded failure; a stop
    signal that arrives while it imports (the suite's SuiteStopped, a KeyboardInterrupt) is not, and goes on: caught,
    it became a failed row that a resumed suite never ran again."""
    import dataclasses

    import pytest

    from kernelarc.suite import SuiteStopped
    from kernelarc.tasks import load_builtin
    from kernelarc.wiring import reference_problem

    task = load_builtin("rmsnorm", cpu=True)

    def with_reference(src: str):
        return dataclasses.replace(task, definition=task.definition.model_copy(update={"reference": src}))

    assert "does not import: SystemExit" in reference_problem(with_reference("import sys\nsys.exit(3)\n"))
    for stop in ("SuiteStopped('SIGTERM')", "KeyboardInterrupt()"):
        with pytest.raises((SuiteStopped, KeyboardInterrupt)):
            reference_problem(with_reference(f"from kernelarc.suite import SuiteStopped\nraise {stop}\n"))
