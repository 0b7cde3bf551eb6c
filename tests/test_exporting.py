"""export_solution: SOL-ExecBench solution.json and standalone python modules."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shared_dirs import from_harness, shared_path

from kernelarc.exporting import export_for_task, export_solution, sol_target_hardware
from kernelarc.models import Candidate

SECRET = "sk-ant-api03-EXPORTSECRET-0123456789"

PYTORCH_SOURCE = """\
from __future__ import annotations

import torch


def run(x, y):
    return torch.softmax(x, dim=-1) * y
"""

TRITON_SOURCE = """\
import torch
import triton
import triton.language as tl


@triton.jit
def _add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + tl.load(y_ptr + offs, mask=mask), mask=mask)


def run(x, y):
    out = torch.empty_like(x)
    n = x.numel()
    _add[(triton.cdiv(n, 1024),)](x, y, out, n, BLOCK=1024)
    return out
"""


SOL_PROBLEMS = shared_path("sol-execbench")


@pytest.fixture(scope="module")
def Solution():  # noqa: N802 - NVIDIA's pydantic class, as the harness loads it
    """NVIDIA's own Solution model (sol_execbench.core.data.solution), from the vendored harness."""
    (model,) = from_harness("sol_execbench.core.data.solution", "Solution")
    return model


def cand(source: str = PYTORCH_SOURCE, language: str = "pytorch", **kw) -> Candidate:
    return Candidate(source=source, language=language, agent="a1", strategy="fusion", **kw)


def test_sol_execbench_value_returning(tmp_path, Solution):  # noqa: N803
    c = cand(family="softmax_mul", knobs={"BLOCK": 128})
    path = export_solution(
        c, "softmax_mul_h4096", tmp_path / "out", "sol-execbench", ["B200", "LOCAL"], "fused softmax", dps=False
    )
    assert path == tmp_path / "out" / "solution.json"
    data = json.loads(path.read_text())
    sol = Solution.model_validate(data)
    assert sol.name == f"softmax_mul_h4096_pytorch_kernelarc_{c.id[:8]}"
    assert sol.definition == "softmax_mul_h4096"
    assert sol.description == "fused softmax"
    assert sol.author == "kernelarc"
    assert [lang.value for lang in sol.spec.languages] == ["pytorch"]
    assert [h.value for h in sol.spec.target_hardware] == ["B200", "LOCAL"]
    assert sol.spec.entry_point == "main.py::run"
    assert sol.spec.destination_passing_style is False
    assert sol.spec.dependencies == ["torch"]
    assert [s.path for s in sol.sources] == ["main.py"]
    assert sol.sources[0].content == PYTORCH_SOURCE
    # The entry file is written beside solution.json and is what the JSON carries.
    assert (tmp_path / "out" / "main.py").read_text() == PYTORCH_SOURCE
    assert not (tmp_path / "out" / "kernelarc.json").exists()


def test_sol_execbench_triton_with_provenance(tmp_path, Solution):  # noqa: N803
    c = cand(TRITON_SOURCE, "triton")
    path = export_solution(
        c,
        "vector_add",
        tmp_path,
        "sol-execbench",
        sol_target_hardware("h200"),
        "triton add",
        name="vector add v1",
        metrics={"latency_ms": 0.01, "speedup_vs_baseline": 1.2},
        provenance={"run_id": "abc", "model_version": 3},
        input_names=["x", "y"],
        output_names=["out"],
    )
    sol = Solution.model_validate_json(path.read_text())
    assert sol.name == "vector_add_v1"
    assert [lang.value for lang in sol.spec.languages] == ["triton"]
    assert [h.value for h in sol.spec.target_hardware] == ["LOCAL"]
    assert sol.spec.destination_passing_style is True
    assert {s.path for s in sol.sources} == {"main.py", "kernelarc_kernel.py"}
    assert sol.spec.dependencies == ["torch", "triton"]
    side = json.loads((tmp_path / "kernelarc.json").read_text())
    assert side["metrics"]["latency_ms"] == 0.01
    assert side["provenance"]["model_version"] == 3
    assert side["candidate"]["id"] == c.id
    assert sol_target_hardware("b200") == ["B200"]


def test_python_module_is_standalone_and_runs(tmp_path):
    c = cand(family="softmax_mul", knobs={"BLOCK": 128}, parent="feedfacefeedface", rationale="fuse")
    path = export_solution(
        c,
        "softmax_mul",
        tmp_path,
        "python",
        ["LOCAL"],
        "fused softmax",
        metrics={"latency_ms": 0.25, "sol_fraction": 0.6},
        provenance={"mlflow_run_id": "r1", "gpu": "h200"},
    )
    assert path == tmp_path / f"softmax_mul_pytorch_kernelarc_{c.id[:8]}.py"
    text = path.read_text()
    header = text.split("\n\n", 1)[0]
    assert all(line.startswith("#") for line in header.splitlines())
    for expected in (
        "softmax_mul",
        c.id,
        "pytorch",
        "latency_ms: 0.25",
        "mlflow_run_id: r1",
        "knobs",
        "feedfacefeedface",
    ):
        assert expected in header
    assert text.endswith(PYTORCH_SOURCE)
    # Still a valid module (the source's `from __future__` import stays legal) and runnable.
    spec = importlib.util.spec_from_file_location("exported_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x, y = torch.randn(3, 5), torch.randn(3, 5)
    torch.testing.assert_close(module.run(x, y), torch.softmax(x, -1) * y)


def test_secrets_are_scrubbed(tmp_path, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    c = cand(PYTORCH_SOURCE + f"# {SECRET}\n", rationale=f"used {SECRET}")
    export_solution(c, "d", tmp_path / "a", "sol-execbench", ["LOCAL"], None, provenance={"key": SECRET},
                    input_names=["x", "y"], output_names=["out"])  # fmt: skip
    export_solution(c, "d", tmp_path / "b", "python", ["LOCAL"], f"desc {SECRET}")
    for p in tmp_path.rglob("*"):
        if p.is_file():
            assert SECRET not in p.read_text(), p


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"fmt": "onnx"}, ValueError, "unknown export format"),
        ({"task_definition_name": " "}, ValueError, "task_definition_name"),
        ({"target_hardware": []}, ValueError, "target_hardware"),
        ({"target_hardware": ["B200", ""]}, ValueError, "target_hardware"),
        ({"candidate": "def run(): pass"}, TypeError, "Candidate"),
        ({"candidate": Candidate(source="def run(:\n", language="pytorch")}, ValueError, "does not parse"),
        (
            {"candidate": Candidate(source="def main(x):\n    return x\n", language="pytorch")},
            ValueError,
            "no top-level `run`",
        ),
        ({"candidate": Candidate(source="def run(x):\n    return x\n", language="cuda")}, ValueError, "language"),
        ({"candidate": Candidate(source="  \n", language="triton")}, ValueError, "empty"),
        ({}, ValueError, "output_names"),  # destination-passing style (the default) needs the outputs
    ],
)
def test_validation_errors(tmp_path, kwargs, error, match):
    args = dict(
        candidate=cand(),
        task_definition_name="softmax",
        out_dir=tmp_path / "out",
        fmt="sol-execbench",
        target_hardware=["LOCAL"],
        description=None,
    )
    args.update(kwargs)
    with pytest.raises(error, match=match):
        export_solution(**args)
    assert not (tmp_path / "out" / "solution.json").exists()


def test_out_dir_must_be_a_directory(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(NotADirectoryError):
        export_solution(cand(), "softmax", f, "python", ["LOCAL"], None)


def test_single_hardware_string_and_run_binding_forms(tmp_path):
    c = Candidate(source="from operator import neg as run\n", language="pytorch")
    data = json.loads(export_solution(c, "neg", tmp_path, "sol-execbench", "B200", None, dps=False).read_text())
    assert data["spec"]["target_hardware"] == ["B200"]
    assert Path(tmp_path / "main.py").read_text() == c.source


def test_shape_dispatch_over_cutlass_and_triton_exports_both_dependencies(tmp_path, Solution):  # noqa: N803
    from kernelarc import dispatch
    from kernelarc.families.cutlass_gemm import CUTLASS_GEMM
    from kernelarc.families.matmul import FAMILIES

    tiled = next(f for f in FAMILIES if f.name == "matmul.tiled")
    cut = Candidate(source=CUTLASS_GEMM.render(CUTLASS_GEMM.start), language="cutlass", family=CUTLASS_GEMM.name)
    tri = Candidate(source=tiled.render(tiled.start), language="triton", family=tiled.name)
    sig = (((16, 8), "torch.bfloat16"), ((8, 8), "torch.bfloat16"))
    src = dispatch.compose([dispatch.Route(tri, [1], [sig], [1.0])], default=cut)
    comp = Candidate(source=src, language=dispatch.composite_language([cut, tri]), family=dispatch.FAMILY)
    assert comp.language == "cutlass"
    data = json.loads(
        export_solution(comp, "gemm", tmp_path / "out", "sol-execbench", ["LOCAL"], "", dps=False).read_text()
    )
    assert data["spec"]["dependencies"] == ["torch", "nvidia-cutlass", "triton"]
    # a Python module that builds CUTLASS itself: a Python solution to the harness, never C++ mixed in
    assert Solution.model_validate(data).spec.languages[0].value == "pytorch"
    assert data["spec"]["languages"] == ["pytorch", "triton"]
    main = (tmp_path / "out" / "main.py").read_text()
    assert "from kernelarc import" not in main  # the CUTLASS helper is inlined into the composite too
    compile(main, "main.py", "exec")


# Runs an exported solution the way NVIDIA's eval driver does (its folder on sys.path, the entry
# module imported by name, DPS: outputs preallocated, poisoned, passed last, nothing returned) on
# one workload of the problem, and compares with the problem's reference under its tolerance.
RUN_EXPORT = """
import importlib, json, math, sys
from pathlib import Path
import torch
from kernelarc.tasks.inputs import load_module, make_inputs, torch_dtype
from kernelarc.tasks.loader import load_task

sol_dir, task_path, wl = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
task = load_task(task_path, cpu=True)
sol = json.loads((sol_dir / "solution.json").read_text())
entry_file, symbol = sol["spec"]["entry_point"].split("::")
sys.path.insert(0, str(sol_dir))
fn = getattr(importlib.import_module(entry_file.removesuffix(".py")), symbol)
inputs = make_inputs(task, wl, 11, "cpu")
ref = load_module(task.definition.reference, "reference").run(
    *[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
if sol["spec"]["destination_passing_style"]:
    outs = []
    for name, spec in task.definition.outputs.items():
        t = torch.empty(task.shape(name, wl) or (), dtype=torch_dtype(spec.dtype))
        t.fill_(math.nan if t.is_floating_point() else -7)
        outs.append(t)
    assert fn(*inputs, *outs) is None, "a DPS entry point returns nothing"
else:
    got = fn(*inputs)
    outs = list(got) if isinstance(got, (tuple, list)) else [got]
assert len(outs) == len(ref)
for name, o, r in zip(task.output_names, outs, ref):
    atol, rtol, _ = task.tolerance(wl, name)
    assert o.dtype == r.dtype and o.shape == r.shape, (name, o.dtype, r.dtype, o.shape, r.shape)
    assert r.abs().max() > 0, "never compare on zeros"
    torch.testing.assert_close(o.float(), r.float(), atol=max(atol, 1e-6), rtol=max(rtol, 1e-6))
print("EXPORT-RUNS", len(outs))
"""


def _run_export(sol_dir: Path, task_path: Path, wl: int) -> subprocess.CompletedProcess:
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    return subprocess.run([sys.executable, "-c", RUN_EXPORT, str(sol_dir), str(task_path), str(wl)],
                          cwd=sol_dir, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.parametrize("dps", [True, False])
def test_builtin_family_kernel_export_validates_and_runs(tmp_path, Solution, dps):  # noqa: N803
    from kernelarc.families import families_for
    from kernelarc.tasks.loader import BUILTIN_DIR, load_builtin

    task = load_builtin("rmsnorm", cpu=True)
    fam = families_for("rmsnorm")[0]
    c = Candidate(source=fam.render(fam.start), language="triton", family=fam.name, knobs=dict(fam.start))
    path = export_for_task(c, task, tmp_path / "sol", "sol-execbench", "h200", dps=dps)
    sol = Solution.model_validate_json(path.read_text())
    assert sol.spec.destination_passing_style is dps and sol.definition == task.definition.name
    assert [lang.value for lang in sol.spec.languages] == ["triton"]
    if dps:  # parameters named as the definition's inputs, then its outputs (the schema's rule)
        main = (tmp_path / "sol" / "main.py").read_text()
        assert f"def run({', '.join(task.input_names + task.output_names)}):" in main
    r = _run_export(tmp_path / "sol", BUILTIN_DIR / "rmsnorm", 0)
    assert r.returncode == 0 and "EXPORT-RUNS 1" in r.stdout, r.stderr[-3000:]


def test_sol_execbench_problem_export_validates_and_runs(tmp_path, Solution):  # noqa: N803
    from kernelarc.guard.judge import reference_candidate
    from kernelarc.tasks.loader import load_task

    problem = SOL_PROBLEMS / "L1" / "034_flux_multi_axis_rope_frequency_computation"
    if not problem.is_dir():
        pytest.skip(f"{problem} is absent")
    task = load_task(problem, cpu=True)
    wl = min(range(len(task.workloads)), key=task.io_bytes)
    path = export_for_task(reference_candidate(task), task, tmp_path / "sol", "sol-execbench", "b200")
    sol = Solution.model_validate_json(path.read_text())
    assert [h.value for h in sol.spec.target_hardware] == ["B200"] and sol.spec.destination_passing_style
    assert len(task.output_names) == 2  # the DPS wrapper fills several outputs
    r = _run_export(tmp_path / "sol", problem, wl)
    assert r.returncode == 0 and "EXPORT-RUNS 2" in r.stdout, r.stderr[-3000:]


def test_dps_entry_rejects_what_the_harness_would_reject(tmp_path):
    src = "import torch\n\ndef run(x):\n    return x.double()\n"  # wrong dtype: a cast would hide it
    export_solution(Candidate(source=src, language="pytorch"), "t", tmp_path, "sol-execbench", "LOCAL",
                    input_names=["x"], output_names=["y"])  # fmt: skip
    sys.path.insert(0, str(tmp_path))
    try:
        mod = importlib.import_module("main")
        x = torch.randn(4)
        with pytest.raises(RuntimeError, match="float64"):
            mod.run(x, torch.empty(4))
        with pytest.raises(RuntimeError, match="shape"):
            mod.run(x, torch.empty(4, 1, dtype=torch.float64))
        y = torch.empty(4, dtype=torch.float64)
        assert mod.run(x, y) is None
        torch.testing.assert_close(y, x.double())
    finally:
        sys.path.remove(str(tmp_path))
        for name in ("main", "kernelarc_kernel"):
            sys.modules.pop(name, None)


def test_a_compiled_solution_compiles_in_process(tmp_path):
    """Exported code that calls torch.compile sets Inductor's compile_threads to 1 (as the guard's
    workers run it): a compile-pool thread started during NVIDIA's timed calls is judged REWARD_HACK."""
    src = (
        "from __future__ import annotations\n\nimport torch\n\n\n"
        "def _ref(x, y):\n    return torch.softmax(x, -1) * y\n\n\n"
        "_fn = torch.compile(_ref, dynamic=False)\n\n\ndef run(x, y):\n    return _fn(x, y)\n"
    )
    path = export_solution(Candidate(source=src, language="pytorch"), "softmax_mul", tmp_path, "python", ["LOCAL"])
    text = path.read_text()
    assert text.count("_kernelarc_inductor_config.compile_threads = 1") == 1
    assert text.index("import torch\n") < text.index("compile_threads = 1") < text.index("torch.compile(")
    compile(text, str(path), "exec")  # the `from __future__` import stays first: still a valid module
    plain = export_solution(cand(family="softmax_mul"), "softmax_mul", tmp_path / "p", "python", ["LOCAL"])
    assert "compile_threads" not in plain.read_text()  # nothing added where nothing compiles
