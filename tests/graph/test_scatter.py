"""Scatter-add sites (``index_add_`` into a clone or a zero buffer, the cast after it included) on the
``scatter_add.sorted`` family: recognised, composed, and equal to the reference in interpreted Triton on the CPU
(duplicate indices, rows that receive nothing, a zero base written out in another dtype)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernelarc.families import families_for, get_family
from kernelarc.families.composed import recognise, start_points
from kernelarc.graph.patterns import Kind
from kernelarc.guard.static import check_source
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

INPUTS = """
import torch


def get_inputs(axes, device):
    R, K, H = axes["R"], axes["K"], axes["H"]
    return {"x": torch.randn(R, H, device=device).to(torch.DTYPE),
            "src": torch.randn(R * K, H, device=device).to(torch.DTYPE),
            "idx": torch.randint(0, R, (R * K,), device=device)}
"""


def reference(dtype: str, body: str) -> str:
    """A reference over INPUTS' inputs in ``dtype``: ``run(x, src, idx)`` with ``body`` (indented lines)."""
    return INPUTS.replace("DTYPE", dtype) + "\n\n@torch.no_grad()\ndef run(x, src, idx):\n" + body


# an MoE combine: the experts' outputs added back at their tokens' rows (L1/008's form)
COMBINE = reference(
    "bfloat16",
    """\
    out = x.clone()
    out.index_add_(0, idx, src)
    return out
""",
)

# an embedding backward: token gradients into a zero fp32 buffer of the vocabulary's rows, written out in bf16
EMBED_BWD = reference(
    "float32",
    """\
    g = torch.zeros(x.shape[0] * 2, x.shape[1], dtype=torch.float32, device=x.device)
    g.index_add_(0, idx, src * 0.5)
    return g.to(torch.bfloat16)
""",
)

# the same sum as index_put_ with accumulate=True, and as scatter_add_ with the row index broadcast over the rows
PUT = COMBINE.replace("out.index_add_(0, idx, src)", "out.index_put_((idx,), src, accumulate=True)")
# index_put_ reads negative indices from the end
PUT_NEG = PUT.replace("(idx,)", "(idx - x.shape[0] * (idx % 2),)")
SCATTER = COMBINE.replace("out.index_add_(0, idx, src)", "out.scatter_add_(0, idx.view(-1, 1).expand_as(src), src)")
SCATTER_FN = COMBINE.replace(
    "out = x.clone()\n    out.index_add_(0, idx, src)\n    return out",
    "return torch.scatter_add(x, 0, idx.unsqueeze(-1).expand(-1, src.shape[1]), src)",
)
# not a row sum: without accumulate a duplicate index keeps one value; an index that varies along the row
PUT_NO_ACC = COMBINE.replace("out.index_add_(0, idx, src)", "out.index_put_((idx,), src)")
SCATTER_2D = COMBINE.replace("out.index_add_(0, idx, src)",
                             "out.scatter_add_(0, (idx.view(-1, 1) + torch.zeros_like(src, dtype=torch.long)) % "
                             "x.shape[0], src)")  # fmt: skip
assert len({COMBINE, PUT, PUT_NEG, SCATTER, SCATTER_FN, PUT_NO_ACC, SCATTER_2D}) == 7

# the buffer is read besides the scatter: not a fresh buffer, so no site
READ_ELSEWHERE = reference(
    "float32",
    """\
    out = x.clone()
    y = out * 2
    out.index_add_(0, idx, src)
    return out + y
""",
)


def _task(root: Path, name: str, reference: str, out_rows: str = "R", out_dtype: str = "bfloat16"):
    folder = root / name
    folder.mkdir(parents=True)
    dt = "bfloat16" if "bfloat16" in reference.split("def run")[0] else "float32"
    defn = {
        "name": name,
        "axes": {"R": {"type": "var"}, "K": {"type": "var"}, "H": {"type": "var"}, "R2": {"type": "expr",
                 "expression": "R * 2"}, "RK": {"type": "expr", "expression": "R * K"}},
        "custom_inputs_entrypoint": "get_inputs",
        "inputs": {"x": {"shape": ["R", "H"], "dtype": dt}, "src": {"shape": ["RK", "H"], "dtype": dt},
                   "idx": {"shape": ["RK"], "dtype": "int64"}},
        "outputs": {"y": {"shape": [out_rows, "H"], "dtype": out_dtype}},
        "reference": reference,
    }  # fmt: skip
    (folder / "definition.json").write_text(json.dumps(defn))
    custom = {"type": "custom"}
    lines = [json.dumps({"uuid": f"w{i}", "axes": ax, "inputs": {"x": custom, "src": custom, "idx": custom}})
             for i, ax in enumerate([{"R": 24, "K": 3, "H": 40}, {"R": 7, "K": 2, "H": 300}])]  # fmt: skip
    (folder / "workload.jsonl").write_text("\n".join(lines) + "\n")
    return load_task(folder)


@pytest.mark.parametrize(
    ("name", "reference", "rows", "out_dtype", "zero"),
    [
        ("p_combine", COMBINE, "R", "bfloat16", False),
        ("p_embed_bwd", EMBED_BWD, "R2", "bfloat16", True),
        ("p_put", PUT, "R", "bfloat16", False),
        ("p_put_neg", PUT_NEG, "R", "bfloat16", False),
        ("p_scatter", SCATTER, "R", "bfloat16", False),
        ("p_scatter_fn", SCATTER_FN, "R", "bfloat16", False),
    ],
)
def test_a_scatter_add_runs_on_the_family_and_matches_the_reference(tmp_path, name, reference, rows, out_dtype, zero):
    task = _task(tmp_path, name, reference, rows, out_dtype)
    rec = recognise(task)
    sites = [s for s in rec.sites[0] if s.kind is Kind.scatter_add]
    assert len(sites) == 1 and sites[0].params["zero"] is zero and sites[0].params["out_dtype"] == out_dtype
    fams = families_for(task)
    fam = next(f for f in fams if f.name.endswith(".scatter_add.sorted"))
    assert start_points(task, fams)[0][0] is fam  # it leads: nothing else here for a kernel
    src = fam.render(fam.start)
    assert check_source(src).ok
    mod = load_module(src, f"scatter_{name}")
    calls: list[int] = []
    real = mod._k0_run
    mod._k0_run = lambda *a: calls.append(1) or real(*a)
    ref = load_module(task.definition.reference, f"scatter_ref_{name}")
    for i in (0, 1):
        args = make_inputs(task, i, 11, "cpu")
        assert args[2].unique().numel() < args[2].numel()  # duplicates: rows that sum several sources
        got, want = mod.run(*args), ref.run(*args)
        assert got.dtype == want.dtype and got.shape == want.shape
        # fp32 sums rounded once against eager's bf16 adds rounded each time: within a few bf16 steps
        torch.testing.assert_close(got.float(), want.float(), atol=0.05, rtol=0.02)
        assert want.float().abs().max() > 0.5
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("name", "reference", "out_dtype"),
    [("p_read_elsewhere", READ_ELSEWHERE, "float32"), ("p_put_no_acc", PUT_NO_ACC, "bfloat16"),
     ("p_scatter_2d", SCATTER_2D, "bfloat16")],
)  # fmt: skip
def test_what_is_not_a_row_sum_into_a_fresh_buffer_is_not_a_site(tmp_path, name, reference, out_dtype):
    task = _task(tmp_path, name, reference, "R", out_dtype)
    rec = recognise(task)
    assert rec.capture is not None
    assert not any(s.kind is Kind.scatter_add for s in rec.sites[0])


def test_the_kernel_on_edge_cases_against_index_add_in_float64():
    """No source rows, a trailing shape of rank 2, a zero base in another dtype, and indices past the rows
    (dropped: eager asserts on them, the kernel sums the rows that exist)."""
    fam = get_family("scatter_add.sorted")
    mod = load_module(fam.render(fam.check_point({"BLOCK_H": 256, "num_warps": 2})), "scatter_edges")
    g = torch.Generator().manual_seed(5)
    base = torch.randn(6, 3, 5, generator=g)
    src = torch.randn(9, 3, 5, generator=g)
    idx = torch.tensor([5, 0, 0, 2, 5, 5, 1, 0, 3])
    want = base.double().index_add(0, idx, src.double())
    torch.testing.assert_close(mod.run(base, idx, src, 6, torch.float32).double(), want, atol=1e-5, rtol=1e-5)
    got = mod.run(None, idx, src, 6, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), torch.zeros_like(want).index_add(0, idx, src.double()), atol=2e-2,
                               rtol=1e-2)  # fmt: skip
    empty = mod.run(base, idx[:0], src[:0], 6, torch.float32)
    torch.testing.assert_close(empty, base)
    past = torch.tensor([0, 7, 2, 6, 2, 1, 0, 9, 3])
    keep = past < 6
    want = base.double().index_add(0, past[keep], src[keep].double())
    torch.testing.assert_close(mod.run(base, past, src, 6, torch.float32).double(), want, atol=1e-5, rtol=1e-5)
