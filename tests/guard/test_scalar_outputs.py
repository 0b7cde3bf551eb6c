"""A scalar output (``shape: null``) returned as a 0-d tensor, as NVIDIA's harness accepts it: a loss from
``F.cross_entropy`` on a problem written for this test (found by running the suite on problems KernelArc had never
seen: the reference itself was judged incorrect, "expected a Python scalar, got Tensor")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.models import Candidate, Status
from kernelarc.tasks.loader import load_task

REFERENCE = """import torch
import torch.nn.functional as F

@torch.no_grad()
def run(logits, labels):
    return F.cross_entropy(logits.float(), labels, reduction="mean")
"""


def _problem(root: Path) -> Path:
    d = root / "L1" / "900_cross_entropy_scalar"
    d.mkdir(parents=True)
    definition = {
        "name": "900_cross_entropy_scalar",
        "description": "mean token cross-entropy, a scalar output",
        "axes": {"n": {"type": "var"}, "v": {"type": "const", "value": 64}},
        "inputs": {"logits": {"shape": ["n", "v"], "dtype": "float32"},
                   "labels": {"shape": ["n"], "dtype": "int64"}},
        "outputs": {"loss": {"shape": None, "dtype": "float32"}},
        "reference": REFERENCE,
    }  # fmt: skip
    (d / "definition.json").write_text(json.dumps(definition))
    wl = {"uuid": "u0", "axes": {"n": 32}, "inputs": {"logits": {"type": "random"}, "labels": {"type": "random"}},
          "tolerance": {"max_atol": 1e-4, "max_rtol": 1e-4}}  # fmt: skip
    (d / "workload.jsonl").write_text(json.dumps(wl) + "\n")
    return d


@pytest.fixture(scope="module")
def guard(tmp_path_factory):
    task = load_task(_problem(tmp_path_factory.mktemp("scalar")), cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=30, target_ms=5, min_iters=3, max_iters=20, prestart=1))
    try:
        yield g
    finally:
        g.close()


def test_a_reference_returning_a_0d_tensor_for_a_scalar_output_is_the_champion(guard):
    v = guard.evaluate(reference_candidate(guard.task), trusted=True).verdict
    assert v.status is Status.champion, v.errors


@pytest.mark.parametrize(
    ("body", "want_correct"),
    [
        ("return float(F.cross_entropy(logits.float(), labels))", True),  # a Python number
        ("return F.cross_entropy(logits.float(), labels)", True),  # a 0-d tensor
        ("return F.cross_entropy(logits.float(), labels) * 1.01", False),  # wrong, as a 0-d tensor
        ("return F.cross_entropy(logits.float(), labels).reshape(1)", False),  # a 1-element tensor is not a scalar
    ],
)
def test_scalar_outputs_are_judged_by_value(guard, body, want_correct):
    src = f"import torch\nimport torch.nn.functional as F\n\n\ndef run(logits, labels):\n    {body}\n"
    v = guard.evaluate(Candidate(source=src, language="pytorch"), timeout_s=30).verdict
    assert v.correct is want_correct, (body, v.status, v.errors)


# Red team 34's class: methods of the candidate's run where the worker reads a scalar output after the clock. A float
# subclass whose __float__ would compute the loss, and a 0-d tensor whose item() was shadowed by a function of the
# candidate's: read by exact type and through torch.Tensor's own methods, neither is the value.
LAZY_FLOAT = """import torch
import torch.nn.functional as F


class _Loss(float):
    def __new__(cls, job):
        self = float.__new__(cls, 0.0)
        self.job = job
        return self

    def __float__(self):
        logits, labels = self.job
        return float(F.cross_entropy(logits.float(), labels))


def run(logits, labels):
    return _Loss((logits, labels))
"""
SHADOWED_ITEM = """import torch
import torch.nn.functional as F


def run(logits, labels):
    out = torch.zeros(())
    out.item = lambda: float(F.cross_entropy(logits.float(), labels))
    return out
"""


@pytest.mark.parametrize("src", [LAZY_FLOAT, SHADOWED_ITEM], ids=["float_subclass", "shadowed_item"])
def test_a_scalar_output_is_read_without_running_the_candidates_code(guard, src):
    v = guard.evaluate(Candidate(source=src, language="pytorch"), trusted=True, timeout_s=30).verdict
    assert not v.correct and v.status is not Status.champion, (v.status, v.errors)
