"""export_solution: SOL-ExecBench solution.json and standalone python modules."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field

from kernelarc.exporting import export_solution, sol_target_hardware
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


# Mirror of SOL-ExecBench's Solution model (src/sol_execbench/data/solution.py, the
# `spec.language` revision that docs/solution.md describes), strict about extra fields.
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SourceFile(_Strict):
    path: str = Field(min_length=1)
    content: str = Field(min_length=1)


class BuildSpec(_Strict):
    language: Literal["python", "triton", "cpp", "cuda"]
    target_hardware: list[str] = Field(min_length=1)
    entry_point: str
    dependencies: list[str] = []
    destination_passing_style: bool = True
    binding: str | None = None


class Solution(_Strict):
    name: str = Field(min_length=1)
    definition: str = Field(min_length=1)
    author: str = Field(min_length=1)
    spec: BuildSpec
    sources: list[SourceFile] = Field(min_length=1)
    description: str | None = None


def cand(source: str = PYTORCH_SOURCE, language: str = "pytorch", **kw) -> Candidate:
    return Candidate(source=source, language=language, agent="a1", strategy="fusion", **kw)


def test_sol_execbench_pytorch(tmp_path):
    c = cand(family="softmax_mul", knobs={"BLOCK": 128})
    path = export_solution(
        c, "softmax_mul_h4096", tmp_path / "out", "sol-execbench", ["B200", "LOCAL"], "fused softmax"
    )
    assert path == tmp_path / "out" / "solution.json"
    data = json.loads(path.read_text())
    sol = Solution.model_validate(data)
    assert sol.name == f"softmax_mul_h4096_pytorch_kernelarc_{c.id[:8]}"
    assert sol.definition == "softmax_mul_h4096"
    assert sol.description == "fused softmax"
    assert sol.author == "kernelarc"
    assert sol.spec.language == "python"
    assert sol.spec.target_hardware == ["B200", "LOCAL"]
    assert sol.spec.entry_point == "main.py::run"
    assert sol.spec.destination_passing_style is False
    assert sol.spec.dependencies == ["torch"]
    assert [s.path for s in sol.sources] == ["main.py"]
    assert sol.sources[0].content == PYTORCH_SOURCE
    # The entry file is written beside solution.json and is what the JSON carries.
    assert (tmp_path / "out" / "main.py").read_text() == PYTORCH_SOURCE
    assert not (tmp_path / "out" / "kernelarc.json").exists()


def test_sol_execbench_triton_with_provenance(tmp_path):
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
    )
    sol = Solution.model_validate_json(path.read_text())
    assert sol.name == "vector_add_v1"
    assert sol.spec.language == "triton"
    assert sol.spec.target_hardware == ["LOCAL"]
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
    export_solution(c, "d", tmp_path / "a", "sol-execbench", ["LOCAL"], None, provenance={"key": SECRET})
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
    data = json.loads(export_solution(c, "neg", tmp_path, "sol-execbench", "B200", None).read_text())
    assert data["spec"]["target_hardware"] == ["B200"]
    assert Path(tmp_path / "main.py").read_text() == c.source


def test_shape_dispatch_over_cutlass_and_triton_exports_both_dependencies(tmp_path):
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
    data = json.loads(export_solution(comp, "gemm", tmp_path / "out", "sol-execbench", ["LOCAL"], "").read_text())
    assert data["spec"]["dependencies"] == ["torch", "nvidia-cutlass", "triton"]
    main = (tmp_path / "out" / "main.py").read_text()
    assert "from kernelarc import" not in main  # the CUTLASS helper is inlined into the composite too
    compile(main, "main.py", "exec")
