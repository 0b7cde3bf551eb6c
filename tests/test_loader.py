import json
from pathlib import Path

import pytest

from kernelarc.tasks import TaskError, builtin_tasks, load_builtin, load_task
from kernelarc.tasks.inputs import load_module, make_inputs

SHARED = Path(__file__).resolve().parents[2] / "shared" / "sol-execbench"
PROBLEMS = sorted(p.parent for p in SHARED.glob("*/*/definition.json"))


def test_all_45_problems_load_and_validate():
    assert len(PROBLEMS) == 45
    for p in PROBLEMS:
        t = load_task(p)
        assert t.workloads and t.definition.reference
        for i in range(len(t.workloads)):
            t.axes(i)


def test_misspelt_tolerance_key_is_ignored_as_nvidias_harness_does_with_a_warning():
    p = next(p for p in PROBLEMS if "required_match_ratio" in (p / "workload.jsonl").read_text())
    t = load_task(p)
    assert any("required_match_ratio" in w and "ignores" in w for w in t.warnings)
    i = next(i for i, w in enumerate(t.workloads) if "required_match_ratio" in (w.tolerance.model_extra or {}))
    assert t.workloads[i].tolerance.model_extra["required_match_ratio"] == 0.98
    rule = t.tolerance_rule(i, t.output_names[0])
    assert rule.ratio == 0.99 and rule.atol == t.workloads[i].tolerance.max_atol


def test_tolerance_defaults_and_fields_are_nvidias(tmp_path):
    d = json.loads((Path(load_builtin("rmsnorm").path) / "definition.json").read_text())
    base = {"uuid": "a", "axes": {"M": 4, "N": 8}, "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}}}
    wls = [
        base,
        {**base, "uuid": "b", "tolerance": {"max_rtol": 0.05}},
        {**base, "uuid": "c", "tolerance": {"max_error_cap": 0.1, "allow_negative_inf": True, "odd": 1}},
    ]
    t = load_task(_write(tmp_path, d, wls))
    out = t.output_names[0]
    assert t.tolerance(0, out) == (1e-2, 1e-2, 0.99)
    assert t.tolerance(1, out) == (1e-2, 0.05, 0.99)
    r = t.tolerance_rule(2, out)
    assert r.max_error_cap == 0.1 and r.allow_negative_inf and r.ratio == 0.99
    assert any("'odd'" in w for w in t.warnings)
    with pytest.raises(TaskError, match="no output"):
        t.tolerance_rule(0, "nope")


@pytest.mark.parametrize(
    "p", [p for p in PROBLEMS if "FlashInfer" in str(p) or "L1/011" in str(p)], ids=lambda p: p.name
)
def test_small_references_run_on_cpu(p):
    t = load_task(p)
    i = min(range(len(t.workloads)), key=t.io_bytes)
    out = load_module(t.definition.reference, "ref").run(*make_inputs(t, i, 0, "cpu"))
    assert out is not None


def test_builtin_tasks_run_on_cpu():
    assert set(builtin_tasks()) >= {"matmul", "attention", "attention_residual", "rmsnorm", "fused_add_rmsnorm",
                                    "softmax", "swiglu", "rope"}  # fmt: skip
    for name in builtin_tasks():
        t = load_builtin(name, cpu=True)
        ref = load_module(t.definition.reference, "ref")
        for i in range(len(t.workloads)):
            ref.run(*make_inputs(t, i, 1, "cpu"))


def test_inputs_are_deterministic_and_not_zero():
    t = load_builtin("rmsnorm", cpu=True)
    a = make_inputs(t, 0, 5, "cpu")
    b = make_inputs(t, 0, 5, "cpu")
    assert all((x == y).all() for x, y in zip(a, b, strict=True))
    assert all(x.abs().sum() > 0 for x in a)


def _write(tmp_path, definition, workloads):
    (tmp_path / "definition.json").write_text(json.dumps(definition))
    (tmp_path / "workload.jsonl").write_text("\n".join(json.dumps(w) for w in workloads))
    return tmp_path


def test_errors_name_file_field_and_expectation(tmp_path):
    d = json.loads((Path(load_builtin("rmsnorm").path) / "definition.json").read_text())
    bad = dict(d, inputs={"x": {"shape": ["M", "Q"], "dtype": "bfloat16"}, "weight": d["inputs"]["weight"]})
    with pytest.raises(TaskError, match="definition.json.*unknown axis 'Q'"):
        load_task(_write(tmp_path, bad, [{"uuid": "a", "axes": {"M": 1, "N": 2}, "inputs": {}}]))
    wl = {"uuid": "a", "axes": {"M": 4}, "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}}}
    with pytest.raises(TaskError, match=r"workload.jsonl:1: field 'axes' lacks var axes \['N'\]"):
        load_task(_write(tmp_path, d, [wl]))
    (tmp_path / "workload.jsonl").write_text("{not json")
    with pytest.raises(TaskError, match="workload.jsonl:1: invalid JSON"):
        load_task(tmp_path)
    with pytest.raises(TaskError, match="unknown task"):
        load_builtin("nope")


def test_a_relative_task_path_is_judged_from_the_workers_folder_too(monkeypatch):
    """``task.path=../shared/...`` loaded in the session but failed every evaluation in the guard's workers, which
    load the folder again from their own working folder ("task folder not found")."""
    from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate

    monkeypatch.chdir(SHARED.parent)
    task = load_task("sol-execbench/FlashInfer-Bench/024_rmsnorm_h2048", cpu=True)
    assert task.path.is_absolute() and task.path == SHARED / "FlashInfer-Bench" / "024_rmsnorm_h2048"
    small = min(range(len(task.workloads)), key=task.io_bytes)
    cfg = GuardConfig(timeout_s=60, target_ms=5, min_iters=3, max_iters=20, prestart=1, workloads=[small])
    g = Guard(task, None, "cpu", cfg)
    try:
        v = g.evaluate(reference_candidate(task), trusted=True).verdict
        assert v.correct, v.errors
    finally:
        g.close()
