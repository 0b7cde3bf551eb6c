"""Sort sites (a stable sort of integer keys in [0, E) with their histogram) on the ``counting_sort.blocked``
family: bincount traced where the reference pins its length, the site recognised only where the keys' bound is
proven, composed, and equal to the reference in interpreted Triton on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _problems import spied_family_module

from kernelarc.families import families_for, get_family
from kernelarc.families.composed import recognise, start_points
from kernelarc.graph.capture import CaptureError, pinned_bincount, trace
from kernelarc.graph.patterns import Kind
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

INPUTS = """
import torch


def get_inputs(axes, device):
    T, K, E = axes["T"], axes["K"], axes["E"]
    return {"ids": torch.randint(0, E, (T, K), dtype=torch.int32, device=device),
            "logits": torch.randn(T, E, device=device)}
"""


def reference(body: str) -> str:
    return INPUTS + "\n\n@torch.no_grad()\ndef run(ids, logits):\n" + body


# L1/058's form: a stable sort for the permutation, the histogram's running sum into E + 1 offsets
ROUTE = reference("""\
    flat = ids.reshape(-1)
    _, order = flat.sort(stable=True)
    offsets = torch.zeros(9, dtype=torch.int32, device=flat.device)
    offsets[1:] = torch.bincount(flat.long(), minlength=8).cumsum(0).to(torch.int32)
    return order.to(torch.int32), offsets
""")
# argsort of topk indices (bounded by the logits' width), the sorted keys read too, the counts without a cumsum
TOPK = reference("""\
    top = torch.topk(logits, 2, dim=-1).indices.flatten()
    keys, order = torch.sort(top, stable=True)
    counts = torch.bincount(top, minlength=8)
    return order, keys * 1, counts + 0
""")
ARGSORT = reference("""\
    top = torch.topk(logits, 2, dim=-1).indices.reshape(-1)
    return torch.argsort(top, stable=True), logits.sum(0)
""")
# not provably bounded: the ids could be anything (no histogram, no topk)
UNBOUNDED = reference("""\
    _, order = ids.reshape(-1).sort(stable=True)
    return order, logits.sum(0)
""")
# a sort that is not stable: equal keys' order is the implementation's
UNSTABLE = TOPK.replace("torch.sort(top, stable=True)", "torch.sort(top)")
# a bincount whose length nothing holds at minlength: its length depends on the values, no graph
LOOSE = reference("""\
    return torch.bincount(ids.reshape(-1).long(), minlength=8).float().sum() * logits
""")
# held there by a broadcast against the logits' last dimension (8), and by being counts of topk indices into 8
BROADCAST = LOOSE.replace(".float().sum() * logits", ".float() * logits")
OF_TOPK = reference("""\
    top = torch.topk(logits, 2, dim=-1).indices.flatten()
    return torch.bincount(top, minlength=8).sum() * logits
""")


def _task(root: Path, name: str, ref: str, outputs: dict) -> object:
    folder = root / name
    folder.mkdir(parents=True)
    defn = {
        "name": name,
        "axes": {"T": {"type": "var"}, "K": {"type": "const", "value": 2}, "E": {"type": "const", "value": 8},
                 "TK": {"type": "expr", "expression": "T * K"}, "E1": {"type": "expr", "expression": "E + 1"}},
        "custom_inputs_entrypoint": "get_inputs",
        "inputs": {"ids": {"shape": ["T", "K"], "dtype": "int32"}, "logits": {"shape": ["T", "E"], "dtype": "float32"}},
        "outputs": outputs,
        "reference": ref,
    }  # fmt: skip
    (folder / "definition.json").write_text(json.dumps(defn))
    custom = {"type": "custom"}
    lines = [json.dumps({"uuid": f"w{i}", "axes": {"T": t}, "inputs": {"ids": custom, "logits": custom}})
             for i, t in enumerate((300, 37))]  # fmt: skip
    (folder / "workload.jsonl").write_text("\n".join(lines) + "\n")
    return load_task(folder)


OUT_ROUTE = {"order": {"shape": ["TK"], "dtype": "int32"}, "offsets": {"shape": ["E1"], "dtype": "int32"}}
OUT_TOPK = {"order": {"shape": ["TK"], "dtype": "int64"}, "keys": {"shape": ["TK"], "dtype": "int64"},
            "counts": {"shape": ["E"], "dtype": "int64"}}  # fmt: skip
OUT_SORT = {"order": {"shape": ["TK"], "dtype": "int64"}, "s": {"shape": ["E"], "dtype": "float32"}}


@pytest.mark.parametrize(
    ("name", "ref", "outputs", "roles"),
    [
        ("s_route", ROUTE, OUT_ROUTE, {"perm", "offsets"}),
        ("s_topk", TOPK, OUT_TOPK, {"perm", "values", "counts"}),
        ("s_argsort", ARGSORT, OUT_SORT, {"perm"}),
    ],
    ids=["route", "topk", "argsort"],
)
def test_a_bounded_stable_sort_runs_on_the_counting_sort_and_matches_the_reference(tmp_path, name, ref, outputs,
                                                                                   roles):  # fmt: skip
    task = _task(tmp_path, name, ref, outputs)
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    sites = [s for s in rec.sites[0] if s.kind is Kind.counting_sort]
    assert len(sites) == 1 and sites[0].params["bins"] == 8
    assert {r for r in ("perm", "values", "counts", "offsets") if sites[0].params[r]} == roles
    fams = families_for(task)
    fam = next(f for f in fams if f.name.endswith(".counting_sort.blocked"))
    assert start_points(task, fams)[0][0] is fam
    mod, calls = spied_family_module(task, "counting_sort.blocked", {"rest": "eager"}, name=f"sort_{name}")
    want_mod = load_module(task.definition.reference, f"sort_ref_{name}")
    for i in (0, 1):
        args = make_inputs(task, i, 7, "cpu")
        got, want = mod.run(*args), want_mod.run(*args)
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            assert torch.equal(g, w)  # a permutation, counts: exact (stable: equal keys keep their input order)
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("name", "ref", "outputs"),
    [("s_unbounded", UNBOUNDED, OUT_SORT), ("s_unstable", UNSTABLE, OUT_TOPK)],
    ids=["unbounded", "unstable"],
)
def test_a_sort_without_a_proven_bound_or_not_stable_is_not_a_site(tmp_path, name, ref, outputs):
    task = _task(tmp_path, name, ref, outputs)
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    sites = [s for s in rec.sites[0] if s.kind is Kind.counting_sort]
    if name == "s_unstable":  # the histogram alone is still a site (its bound is the topk's)
        assert len(sites) == 1 and not sites[0].params["perm"] and sites[0].params["counts"]
    else:
        assert not sites


def test_bincount_traces_only_where_the_graph_pins_its_length():
    """bincount has no fake kernel: tracing gives it ``minlength`` entries for the trace only, and a graph where
    nothing holds its length there is refused (its length depends on the values)."""
    ns: dict = {}
    exec(ROUTE, ns)  # noqa: S102 - the test's own reference
    ids = torch.empty(30, 2, dtype=torch.int32, device="meta")
    gm = trace(ns["run"], [ids, torch.empty(30, 8, device="meta")], symbolic=False)
    assert any(n.target is torch.ops.aten.bincount.default for n in gm.graph.nodes)
    for pinned in (BROADCAST, OF_TOPK):
        exec(pinned, ns)  # noqa: S102
        trace(ns["run"], [ids, torch.empty(30, 8, device="meta")], symbolic=False)
    exec(LOOSE, ns)  # noqa: S102
    with pytest.raises(CaptureError, match="bincount's length depends on its values"):
        trace(ns["run"], [ids, torch.empty(30, 8, device="meta")], symbolic=False)
    exec(OF_TOPK.replace("minlength=8", "minlength=6"), ns)  # noqa: S102 - indices into 8: up to 8 entries
    with pytest.raises(CaptureError, match="bincount's length depends on its values"):
        trace(ns["run"], [ids, torch.empty(30, 8, device="meta")], symbolic=False)
    # the meta kernel lives for the trace only
    assert not torch._C._dispatch_has_kernel_for_dispatch_key("aten::bincount", "Meta")
    with pinned_bincount():
        assert torch.bincount(torch.empty(5, dtype=torch.int64, device="meta"), minlength=4).shape == (4,)
    with pytest.raises(NotImplementedError):
        torch.bincount(torch.empty(5, dtype=torch.int64, device="meta"), minlength=4)


@pytest.mark.parametrize("block", [256, 1024])
def test_the_kernel_against_torch_on_edge_cases(block):
    """Empty and one-key inputs, int64 keys, a single bin, several blocks, keys outside [0, bins) (neither counted
    nor placed: the keys in range come out in stable order)."""
    fam = get_family("counting_sort.blocked")
    mod = load_module(fam.render(fam.check_point({"BLOCK": block, "num_warps": 2})), f"csort_{block}")
    g = torch.Generator().manual_seed(3)
    for n, e, dt in ((0, 4, torch.int32), (1, 4, torch.int64), (700, 1, torch.int32), (1500, 5, torch.int64)):
        k = torch.randint(0, e, (n,), generator=g, dtype=dt)
        perm, vals, hist, offs = mod.run(k, e, True, True, True, True)
        v, p = k.sort(stable=True)
        h = torch.bincount(k.long(), minlength=e)
        assert torch.equal(perm, p) and torch.equal(vals, v) and vals.dtype == dt
        assert torch.equal(hist, h) and torch.equal(offs, h.cumsum(0))
    k = torch.randint(-3, 9, (900,), generator=g)
    perm, vals, hist, offs = mod.run(k, 6, True, False, True, False)
    assert vals is None and offs is None
    ok = (k >= 0) & (k < 6)
    assert torch.equal(hist, torch.bincount(k[ok], minlength=6))
    inside = torch.nonzero(ok).flatten()
    assert torch.equal(perm[: inside.numel()], inside[k[ok].sort(stable=True).indices])
    assert mod.run(k.view(30, 30), 6) is None and mod.run(k.float(), 6) is None  # not what it takes


def _meta(*shape, dtype=torch.int32):
    return torch.empty(*shape, dtype=dtype, device="meta")


def _pinned_loose(ids, logits):
    c = torch.bincount(ids.reshape(-1).long(), minlength=8)
    return c.cumsum(0) - c  # its partner has the traced length because it is computed from it: nothing pinned


def _copied_into_its_like(ids, logits):
    c = torch.bincount(ids.reshape(-1).long(), minlength=8)
    out = torch.empty_like(c)
    out.copy_(c)
    return out


def _expanded_keeping_length(ids, logits):
    return torch.bincount(ids.reshape(-1).long(), minlength=8).expand(2, -1)


@pytest.mark.parametrize("fn", [_pinned_loose, _copied_into_its_like, _expanded_keeping_length])
def test_a_partner_that_repeats_the_traced_length_pins_nothing(fn):
    """Eager runs these for ids of 8 and more (a longer histogram): tracing them would bake in the 8 entries."""
    with pytest.raises(CaptureError, match="bincount's length depends on its values"):
        trace(fn, [_meta(30, 2), _meta(30, 8, dtype=torch.float32)], symbolic=False)


def _dtype_view(top_ids, w):
    keys = top_ids.view(torch.int32)  # another dtype's view: twice as many values, not the same ones
    _, order = torch.sort(keys, stable=True)
    return order, torch.bincount(top_ids, minlength=8) + w


def _sign_cast(x, w):
    _, order = torch.sort(x.to(torch.int32), stable=True)
    return order, torch.bincount(x.to(torch.uint8), minlength=256) + w  # uint8 wraps int8's negatives


def _written_between(ids, w):
    flat = ids.reshape(-1).long()
    alias = flat.view(-1)
    _, order = flat.sort(stable=True)
    alias.mul_(3).remainder_(8)  # the sort read the keys before this: a kernel run after it would not
    return order, torch.bincount(flat, minlength=8) + w


@pytest.mark.parametrize(
    ("fn", "args"),
    [(_dtype_view, [_meta(60, dtype=torch.int64), _meta(8, dtype=torch.int64)]),
     (_sign_cast, [_meta(60, dtype=torch.int8), _meta(256, dtype=torch.int64)]),
     (_written_between, [_meta(30, 2, dtype=torch.int64), _meta(8, dtype=torch.int64)])],
    ids=["dtype_view", "sign_cast", "written_between"],
)  # fmt: skip
def test_a_sort_is_not_joined_to_a_histogram_of_other_values_or_across_a_write(fn, args):
    from kernelarc.graph.sorting import sort_sites

    gm = trace(fn, args, symbolic=False)
    sites = sort_sites(gm, set())
    assert not any(s.params["perm"] for s in sites)  # no sort site: only a histogram of its own (or nothing)
    if fn is _dtype_view:  # the histogram alone still is one (its keys are int64: what the kernel reads)
        assert len(sites) == 1 and sites[0].params["counts"]


def test_the_kernel_declines_more_bins_than_it_holds():
    from kernelarc.graph.sorting import MAX_BINS

    mod = load_module(get_family("counting_sort.blocked").render({"BLOCK": 1024, "num_warps": 4}), "csort_bins")
    assert mod.MAX_BINS == MAX_BINS
    keys = torch.randint(0, 10, (50,))
    assert mod.run(keys, MAX_BINS + 1, True, False, True, False) is None
    assert mod.run(keys, 0) is None


def test_both_kernels_compile_for_sm90a(tmp_path):
    """tl.histogram and tl.sort as Triton lowers them for Hopper (the interpreter runs neither through that)."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "families"))
    from _aot import aot_compile

    fam = get_family("counting_sort.blocked")
    d16 = [["tt.divisibility", 16]]
    items = []
    # sizes as i32 (Triton's launch) and as i64 (how Inductor may pass them from a compiled graph: trace_kernels)
    for kdt, block, warps, ix in (("i32", 1024, 4, "i32"), ("i64", 4096, 8, "i32"), ("i32", 256, 2, "i64")):
        counts = {"keys_ptr": f"*{kdt}", "cnt_ptr": "*i32", "N": ix, "E": ix, "BLOCK": "constexpr",
                  "BINS": "constexpr"}  # fmt: skip
        consts = {"BLOCK": block, "BINS": 256, "RB": 16, "SORT": True, "VALUES": True, "COUNTS": True, "OFFSETS": True}
        place = {"keys_ptr": f"*{kdt}", "cnt_ptr": "*i32", "adj_ptr": "*i32", "perm_ptr": "*i64",
                 "vals_ptr": f"*{kdt}", "counts_ptr": "*i64", "offs_ptr": "*i64", "N": ix, "NB": ix, "E": ix,
                 **{n: "constexpr" for n in consts}}  # fmt: skip
        opts = {"num_warps": warps}
        jobs = [dict(kernel="_block_counts", signature=counts, constexprs={"BLOCK": block, "BINS": 256},
                     attrs={(0,): d16, (1,): d16}, options=opts),
                dict(kernel="_place", signature=place, constexprs=consts, attrs={(0,): d16, (1,): d16},
                     options=opts)]  # fmt: skip
        items.append((f"{kdt}_{block}_{ix}", fam.render({"BLOCK": block, "num_warps": warps}), jobs))
    for label, res in aot_compile(items, tmp_path).items():
        for r in res:
            assert "error" not in r, (label, r.get("error"))
            assert r["sm90a"], label
