"""Variable-length attention over cumulative offsets (``cu_seqlens``) read on the host: captured with
the offsets baked, recognised as one per-segment attention site, and composed so that it is right for
offsets other than the traced ones; a reference whose other ops depend on the offsets is not served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kernelarc.families import families_for
from kernelarc.families.composed import recognise
from kernelarc.guard.static import check_source
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

VARLEN = """
import torch
import torch.nn.functional as F


def get_inputs(axes, device):
    T, N = axes["T"], axes["N"]
    inner = torch.randperm(T - 1, device=device)[: N - 2] + 1
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), inner.sort().values,
                    torch.full((1,), T, dtype=torch.int64, device=device)])
    return {"x": torch.randn(T, 16, device=device), "w": torch.randn(3 * 16, 16, device=device) * 0.3,
            "cu_seqlens": cu}


@torch.no_grad()
def run(x, w, cu_seqlens):
    T = x.shape[0]
    qkv = F.linear(x, w).reshape(T, 3, 2, 8).permute(1, 2, 0, 3)  # (3, heads, T, dim)
    q, k, v = qkv.unbind(0)
    outs = []
    for i in range(cu_seqlens.shape[0] - 1):
        s, e = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        if e == s:
            continue
        a = torch.softmax(q[:, s:e] @ k[:, s:e].transpose(-1, -2) * 8 ** -0.5, dim=-1)
        outs.append((a @ v[:, s:e]).transpose(0, 1))
    return torch.cat(outs, dim=0).reshape(T, 16)
"""

# the torch.split form, with the lengths from the offsets (tensor arithmetic on them, then .tolist())
VARLEN_SPLIT = VARLEN.replace(
    """    for i in range(cu_seqlens.shape[0] - 1):
        s, e = cu_seqlens[i].item(), cu_seqlens[i + 1].item()
        if e == s:
            continue
        a = torch.softmax(q[:, s:e] @ k[:, s:e].transpose(-1, -2) * 8 ** -0.5, dim=-1)
        outs.append((a @ v[:, s:e]).transpose(0, 1))""",
    """    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    for qs, ks, vs in zip(q.split(lengths, 1), k.split(lengths, 1), v.split(lengths, 1)):
        a = torch.softmax(qs @ ks.transpose(-1, -2) * 8 ** -0.5, dim=-1)
        outs.append((a @ vs).transpose(0, 1))""",
)
assert VARLEN_SPLIT != VARLEN

# the offsets also decide an op outside the attention: a graph traced with some offsets is wrong for others
VARLEN_LEAKS = VARLEN.replace("return torch.cat(outs, dim=0).reshape(T, 16)",
                              "return torch.cat(outs, dim=0).reshape(T, 16) * cu_seqlens[1].item()")  # fmt: skip


def _task(root: Path, name: str, reference: str) -> object:
    folder = root / name
    folder.mkdir(parents=True)
    defn = {
        "name": name,
        "axes": {"T": {"type": "var"}, "N": {"type": "var"}},
        "custom_inputs_entrypoint": "get_inputs",
        "inputs": {"x": {"shape": ["T", "16"], "dtype": "float32"}, "w": {"shape": ["48", "16"], "dtype": "float32"},
                   "cu_seqlens": {"shape": ["N"], "dtype": "int64"}},
        "outputs": {"y": {"shape": ["T", "16"], "dtype": "float32"}},
        "reference": reference,
    }  # fmt: skip
    (folder / "definition.json").write_text(json.dumps(defn))
    custom = {"type": "custom"}
    lines = [json.dumps({"uuid": f"w{i}", "axes": ax, "inputs": {"x": custom, "w": custom, "cu_seqlens": custom}})
             for i, ax in enumerate([{"T": 24, "N": 4}, {"T": 31, "N": 6}])]  # fmt: skip
    (folder / "workload.jsonl").write_text("\n".join(lines) + "\n")
    return load_task(folder)


@pytest.mark.parametrize("reference", [VARLEN, VARLEN_SPLIT], ids=["item_slices", "split_lengths"])
def test_varlen_attention_runs_per_segment_for_any_offsets(tmp_path, reference):
    task = _task(tmp_path, "p_varlen", reference)
    rec = recognise(task)
    assert rec.capture is not None and all(c.baked for c in rec.capture.cases) and not rec.capture.uncovered
    varlen = [s for s in rec.sites[0] if s.params.get("style") == "varlen"]
    assert len(varlen) == 1 and varlen[0].params["segments"] == 3
    fam = next(f for f in families_for(task) if f.name.endswith(".library"))
    assert "cuda_graph" not in {k.name for k in fam.knobs}  # offsets read on the host: no graph capture
    # even where the knobs ask for the graph's own attention ops, the varlen site runs per segment
    for knobs in ({}, {"attention_impl": "graph"}):
        src = fam.render(fam.check_point(knobs))
        assert check_source(src).ok and ".tolist()" in src
        mod = load_module(src, f"varlen_{len(knobs)}")
        ref = load_module(task.definition.reference, "varlen_ref")
        for i in (0, 1):
            for seed in (3, 4):  # offsets other than the traced ones (seed 0)
                args = make_inputs(task, i, seed, "cpu")
                traced = [n.meta["baked"] for n in rec.capture.cases[i].gm.graph.nodes if "baked" in n.meta][0]
                assert args[2].tolist() != traced
                got, want = mod.run(*args), ref.run(*args)
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
                assert want.abs().max() > 0.1


def test_offsets_read_outside_the_attention_keep_the_reference(tmp_path):
    task = _task(tmp_path, "p_varlen_leak", VARLEN_LEAKS)
    rec = recognise(task)
    assert rec.capture is None and "host" in (rec.error or "")
    assert families_for(task) == []


# offsets built from the axes alone (as L2/017's get_inputs builds cu_seqlens): every input seed gives the same ones
EVEN = VARLEN_LEAKS.replace(
    """    inner = torch.randperm(T - 1, device=device)[: N - 2] + 1
    cu = torch.cat([torch.zeros(1, dtype=torch.int64, device=device), inner.sort().values,
                    torch.full((1,), T, dtype=torch.int64, device=device)])""",
    """    cu = torch.tensor([i * T // (N - 1) for i in range(N)], dtype=torch.int64, device=device)""",
)
assert EVEN != VARLEN_LEAKS


def test_offsets_fixed_by_the_axes_serve_the_traced_values_and_check_them_on_the_host(tmp_path, monkeypatch):
    """Where the offsets decide ops no varlen site covers but every input seed gives the same offsets, the graph
    traced with them is kept for those values only: the candidate reads them on the host and runs the reference
    for any others. The offsets are built without the float inputs (no workload is small enough here to build them
    all on the CPU: L2/017's are 400-770 MB)."""
    from kernelarc.graph import capture

    monkeypatch.setattr(capture, "MAX_CUSTOM_CPU_BYTES", 0)
    task = _task(tmp_path, "p_varlen_even", EVEN)
    rec = recognise(task)
    assert rec.capture is not None and not rec.capture.uncovered
    assert all(c.baked and c.specialized for c in rec.capture.cases)
    fam = next(f for f in families_for(task) if f.name.endswith(".library"))
    src = fam.render(fam.start)
    assert check_source(src).ok and "_VALUES = {" in src
    ref = load_module(task.definition.reference, "even_ref")
    for graph_impl in (False, True):  # the site's own ops too (no varlen loop covers these offsets)
        mod = load_module(fam.render(fam.check_point({"attention_impl": "graph"} if graph_impl else {})),
                          f"even_{graph_impl}")  # fmt: skip
        fell_back: list[int] = []
        real = mod._ref_run
        mod._ref_run = lambda *a, _f=fell_back, _r=real: _f.append(1) or _r(*a)
        for i in (0, 1):
            args = make_inputs(task, i, 5, "cpu")
            torch.testing.assert_close(mod.run(*args), ref.run(*args), atol=1e-5, rtol=1e-5)
        assert fell_back == []  # the traced offsets: the composed graphs ran
        args = make_inputs(task, 1, 5, "cpu")
        args[2] = torch.tensor([0, 3, 9, 10, 20, 31], dtype=torch.int64)  # other offsets, same shape
        got = mod.run(*args)
        assert fell_back == [1]
        torch.testing.assert_close(got, ref.run(*args), atol=1e-5, rtol=1e-5)
