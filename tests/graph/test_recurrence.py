"""Per-step recurrences (``kernelarc.graph.recurrence``): references written as Python loops over a time
axis, which capture refuses (GraphTooLarge), recognised by structure and emitted as one Triton kernel
that walks the steps with the carried state in registers; checked against the reference on the CPU
(Triton's interpreter) for loop lengths and batch sizes never traced."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from _problems import make_task
from shared_dirs import SKIP_REASON, shared_path

import kernelarc.graph.capture as capture
from kernelarc.families import families_for
from kernelarc.families.composed import recognise, start_points
from kernelarc.graph.recurrence import RecurrenceError, recognise_recurrence
from kernelarc.guard.static import check_source
from kernelarc.tasks.inputs import load_module, make_inputs
from kernelarc.tasks.loader import load_task

SOL = shared_path("sol-execbench")  # ../shared beside the checkout, or .shared/ on the GPU machine
needs_sol = pytest.mark.skipif(not SOL.is_dir(), reason=f"sol-execbench {SKIP_REASON}")


@pytest.fixture(autouse=True)
def small_graphs(monkeypatch):
    """Capture refuses loops of a few dozen steps here (GraphTooLarge at 300 nodes), as it refuses thousands
    on real problems: the recurrence path without seconds of tracing per test."""
    monkeypatch.setattr(capture, "MAX_GRAPH_NODES", 300)


# RWKV's WKV recurrence (three carried states, max-stabilised exponentials), written from scratch
WKV = """
import torch

@torch.no_grad()
def run(w, u, k, v, aa, bb, pp):
    aa, bb, pp = aa.clone(), bb.clone(), pp.clone()
    ew = -torch.exp(w.float())
    y = torch.zeros_like(k)
    for t in range(k.shape[1]):
        kt = k[:, t].float()
        vt = v[:, t]
        ww = u + kt
        p = torch.maximum(pp, ww)
        e1 = torch.exp(pp - p)
        e2 = torch.exp(ww - p)
        y[:, t] = (e1 * aa + e2 * vt) / (e1 * bb + e2)
        ww = pp + ew
        p = torch.maximum(ww, kt)
        e1 = torch.exp(ww - p)
        e2 = torch.exp(kt - p)
        aa = e1 * aa + e2 * vt
        bb = e1 * bb + e2
        pp = p
    return y, aa, bb, pp
"""

EMA = """
import torch

def run(x, a):
    B, T, H = x.shape
    h = torch.zeros(B, H, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    for t in range(T):
        h = a * h + (1 - a) * x[:, t]
        out[:, t] = h
    return out, h
"""

# two carried states, a running max and a decayed sum, and the output only at the end
TWO_STATES = """
import torch

def run(x, y, c0, d):
    c = c0.clone()
    m = torch.zeros_like(c0)
    for t in range(x.shape[1]):
        m = torch.maximum(m * d, x[:, t])
        c = c * d + torch.tanh(y[:, t]) * torch.sigmoid(m)
    return c - m, c
"""

# backwards over time, the first step before the loop
REVERSE = """
import torch

def run(x, g):
    T = x.shape[1]
    out = torch.zeros_like(x)
    h = x[:, T - 1] * 2.0
    out[:, T - 1] = h
    for t in range(T - 2, -1, -1):
        h = torch.where(x[:, t] > 0, h * g + x[:, t], h - g)
        out[:, t] = h.clamp(-4.0, 4.0)
    return out
"""

# the loop length and the step index as numbers, an output allocated with the loop length, a reduction after
NUMBERS = """
import torch

def run(x, d):
    B, T, H = x.shape
    out = torch.zeros(B, T, H, dtype=torch.float32, device=x.device)
    h = torch.ones(B, H, device=x.device)
    for t in range(T):
        h = h * d + (t * 0.5) * x[:, t] + float(T)
        out[:, t] = torch.relu(h) - t
    return out.sum(1) / T, out
"""

MATMUL = """
import torch

def run(x, w):
    h = torch.zeros(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        h = torch.tanh(h @ w + x[:, t])
        out[:, t] = h
    return out
"""

# second order, but the older value is only read by ops that can run in the step before: a first-order
# recurrence over a rotated step (its products carried)
SECOND_ORDER = """
import torch

def run(x, a):
    h1 = torch.zeros_like(x[:, 0])
    h2 = torch.zeros_like(x[:, 0])
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        new = a * h1 + (1 - a) * h2 + x[:, t]
        h2 = h1
        h1 = new
        out[:, t] = new
    return out
"""

# the value of two steps back meets the step's own value in one op: no rotation carries it
TWO_BACK = """
import torch

def run(x, a):
    h1 = torch.zeros_like(x[:, 0])
    h2 = torch.zeros_like(x[:, 0])
    out = torch.empty_like(x)
    for t in range(x.shape[1]):
        new = a * h1 + x[:, t]
        out[:, t] = new + h2
        h2 = h1
        h1 = new
    return out
"""

INTO_INPUT = """
import torch

def run(x, a, out):
    h = torch.zeros_like(x[:, 0])
    for t in range(x.shape[1]):
        h = a * h + x[:, t]
        out[:, t] = h
    return out.clone()
"""


def wkv_task(tmp_path, name="p_wkv", workloads=None):
    bc, c, f = (["B", "C"], "float32"), (["C"], "float32"), (["B", "T", "C"], "float32")
    return make_task(tmp_path, name, WKV,
                     {"w": c, "u": c, "k": f, "v": f, "aa": bc, "bb": bc, "pp": bc},
                     {"y": f, "aa_out": bc, "bb_out": bc, "pp_out": bc},
                     workloads or [{"B": 2, "T": 64, "C": 48}, {"B": 3, "T": 80, "C": 40}])  # fmt: skip


def ema_task(tmp_path, dtype="float32", name="p_ema"):
    f = (["B", "T", "H"], dtype)
    return make_task(tmp_path, name, EMA, {"x": f, "a": (["H"], dtype)}, {"out": f, "h": (["B", "H"], dtype)},
                     [{"B": 2, "T": 100, "H": 40}, {"B": 5, "T": 70, "H": 24}])  # fmt: skip


def recurrence_module(task, knobs: dict | None = None):
    """The recurrence family's candidate for ``knobs`` (its start point by default), loaded, with a counter of
    its kernel launches (a silent fallback to the reference leaves it at zero)."""
    fams = families_for(task)
    fam = next(f for f in fams if f.name == f"composed.{task.name}.recurrence")
    src = fam.render(fam.check_point(knobs or {}))
    rep = check_source(src)
    assert rep.ok, rep
    mod = load_module(src, f"rec_{task.name}_{abs(hash(src))}")
    launches: list[int] = []
    for name in [n for n in vars(mod) if n.startswith("_rk")]:
        real = getattr(mod, name)

        class Counted:
            def __getitem__(self, grid, real=real):
                launches.append(1)
                return real[grid]

        setattr(mod, name, Counted())
    return mod, launches


def check(task, mod, shapes: list[dict[str, int]], seeds=(0, 1), atol=1e-5, rtol=1e-5):
    ref = load_module(task.definition.reference, f"ref_{task.name}")
    for axes in shapes:
        wl = task.workloads[0].model_copy(update={"axes": axes})
        one = dataclasses.replace(task, workloads=[wl])
        for seed in seeds:
            args = make_inputs(one, 0, seed, "cpu")
            got, want = mod.run(*[a.clone() if isinstance(a, torch.Tensor) else a for a in args]), ref.run(*args)
            got, want = (list(x) if isinstance(x, tuple | list) else [x] for x in (got, want))
            assert len(got) == len(want)
            for g, w in zip(got, want, strict=True):
                assert g.shape == w.shape and g.dtype == w.dtype
                torch.testing.assert_close(g, w, atol=atol, rtol=rtol)


def test_wkv_recurrence_is_recognised_and_matches_the_reference(tmp_path):
    task = wkv_task(tmp_path)
    rec = recognise(task)
    assert rec.capture is None and rec.too_large and rec.recurrence is not None
    r = rec.recurrence
    assert r.axis == "T" and len(r.cases) == 2 and not r.uncovered
    plan = r.cases[0].plan
    assert len(plan.states) == 3 and sum(it.kind == "store" for it in plan.items) == 1
    assert plan.L == (2, 48) and r.cases[0].tmin == 1
    fams = families_for(task)
    assert [f.name for f in fams] == ["composed.p_wkv.recurrence"]
    points = start_points(task, fams)
    assert points and points[0] == (fams[0], dict(fams[0].start)) and len(points) >= 2
    # 2 x 48 = 96 lanes: BLOCK 64 leaves a partial program; T = 1 (the shortest), lengths never traced, a
    # remainder after UNROLL 4
    mod, launches = recurrence_module(task)
    check(task, mod, [{"B": 2, "T": 1, "C": 48}, {"B": 2, "T": 9, "C": 48}, {"B": 3, "T": 14, "C": 40}])
    assert len(launches) == 6
    mod, launches = recurrence_module(task, {"BLOCK": 32, "num_warps": 1, "UNROLL": 1, "precision": "fast"})
    check(task, mod, [{"B": 3, "T": 7, "C": 40}])
    assert len(launches) == 2
    # shapes no workload has run the reference
    check(task, mod, [{"B": 4, "T": 5, "C": 40}])
    assert len(launches) == 2


def test_ema_with_a_per_channel_parameter(tmp_path):
    task = ema_task(tmp_path)
    r = recognise(task).recurrence
    assert r is not None
    plan = r.cases[0].plan
    assert len(plan.states) == 1 and any(it.invariant for it in plan.items)  # 1 - a: computed before the loop
    mod, launches = recurrence_module(task, {"UNROLL": 8})
    check(task, mod, [{"B": 2, "T": 19, "H": 40}, {"B": 5, "T": 3, "H": 24}, {"B": 2, "T": 8, "H": 40}])
    assert len(launches) == 6


def test_ema_in_bfloat16_rounds_as_the_reference_does(tmp_path):
    task = ema_task(tmp_path, "bfloat16", "p_ema_bf16")
    mod, launches = recurrence_module(task)
    check(task, mod, [{"B": 2, "T": 11, "H": 40}], atol=1e-2, rtol=1e-2)
    assert len(launches) == 2


def test_two_carried_states_and_values_read_after_the_loop(tmp_path):
    f, bh = (["B", "T", "H"], "float32"), (["B", "H"], "float32")
    task = make_task(tmp_path, "p_two", TWO_STATES, {"x": f, "y": f, "c0": bh, "d": (["H"], "float32")},
                     {"o": bh, "c": bh}, [{"B": 3, "T": 90, "H": 33}])  # fmt: skip
    r = recognise(task).recurrence
    assert r is not None and len(r.cases[0].plan.states) == 2
    assert not any(it.kind == "store" for it in r.cases[0].plan.items)
    mod, launches = recurrence_module(task, {"UNROLL": 2})
    check(task, mod, [{"B": 3, "T": 1, "H": 33}, {"B": 3, "T": 12, "H": 33}])
    assert len(launches) == 4


def test_reverse_loop_with_its_first_step_before_it(tmp_path):
    f = (["B", "T", "H"], "float32")
    task = make_task(tmp_path, "p_rev", REVERSE, {"x": f, "g": (["H"], "float32")}, {"out": f},
                     [{"B": 2, "T": 120, "H": 20}])  # fmt: skip
    r = recognise(task).recurrence
    assert r is not None
    case = r.cases[0]
    assert case.template.geo.dk == -1 and case.tmin == 2  # T - 1 steps; a loop of one step is not checked
    mod, launches = recurrence_module(task)
    check(task, mod, [{"B": 2, "T": 2, "H": 20}, {"B": 2, "T": 10, "H": 20}])
    assert len(launches) == 4


def test_loop_length_and_step_index_as_numbers(tmp_path):
    f = (["B", "T", "H"], "float32")
    task = make_task(tmp_path, "p_numbers", NUMBERS, {"x": f, "d": (["H"], "float32")},
                     {"s": (["B", "H"], "float32"), "out": f}, [{"B": 2, "T": 80, "H": 24}])  # fmt: skip
    assert recognise(task).recurrence is not None
    mod, launches = recurrence_module(task)
    src = Path(mod.__file__).read_text()
    # T written as the run-time length; the zero fill the stores overwrite is dropped
    assert "torch.ops.aten.empty.memory_format([2, T, 24]" in src and "div.Tensor(v_sum_1, T)" in src
    check(task, mod, [{"B": 2, "T": 1, "H": 24}, {"B": 2, "T": 13, "H": 24}])
    assert len(launches) == 4


def test_second_order_loop_carried_through_a_rotated_step(tmp_path):
    f = (["B", "T", "H"], "float32")
    task = make_task(tmp_path, "p_second", SECOND_ORDER, {"x": f, "a": (["H"], "float32")}, {"out": f},
                     [{"B": 2, "T": 80, "H": 16}])  # fmt: skip
    r = recognise(task).recurrence
    assert r is not None and len(r.cases[0].plan.states) == 3
    mod, launches = recurrence_module(task)
    check(task, mod, [{"B": 2, "T": 2, "H": 16}, {"B": 2, "T": 11, "H": 16}])
    assert len(launches) == 4


@pytest.mark.parametrize(
    ("source", "why"),
    [
        (MATMUL, "matmul in the loop body is not pointwise"),
        (TWO_BACK, "reads a value of step"),
        (INTO_INPUT, "did not create before the loop"),
    ],
)
def test_loops_that_are_not_pointwise_recurrences_are_refused(tmp_path, source, why):
    f = (["B", "T", "H"], "float32")
    if source is MATMUL:
        ins = {"x": f, "w": (["H", "H"], "float32")}
    elif source is INTO_INPUT:
        ins = {"x": f, "a": (["H"], "float32"), "out": f}
    else:
        ins = {"x": f, "a": (["H"], "float32")}
    task = make_task(tmp_path, "p_refused", source, ins, {"out": f}, [{"B": 2, "T": 80, "H": 16}])
    with pytest.raises(RecurrenceError, match=why):
        recognise_recurrence(task)
    rec = recognise(task)
    assert rec.too_large and rec.recurrence is None and why in (rec.error or "")
    assert families_for(task) == []


@pytest.mark.skipif(not SOL.is_dir(), reason=f"sol-execbench {SKIP_REASON}")
def test_rwkv_time_decay_problem_gets_a_recurrence_kernel():
    """L1/094 (the RWKV WKV loop; 80k launches per call as written): two of its workloads, recognised through
    the composed families and checked on loop lengths it never traced, at batch 1 and 2."""
    full = load_task(SOL / "L1" / "094_time_decay_exponential_stabilization")
    keep = [next(w for w in full.workloads if w.axes["batch_size"] == b) for b in (1, 2)]
    task = dataclasses.replace(full, workloads=keep)
    rec = recognise(task)
    assert rec.capture is None and rec.recurrence is not None, rec.error
    assert rec.recurrence.axis == "seq_len" and len(rec.recurrence.cases) == 2
    assert all(len(c.plan.states) == 3 and c.tmin == 1 for c in rec.recurrence.cases)
    mod, launches = recurrence_module(task, {"BLOCK": 1024, "num_warps": 8})
    ref = load_module(task.definition.reference, "ref_l1_094")
    for b, t in ((1, 5), (1, 1), (2, 9)):
        wl = task.workloads[0].model_copy(update={"axes": {"batch_size": b, "seq_len": t}})
        args = make_inputs(dataclasses.replace(task, workloads=[wl]), 0, 3, "cpu")
        for g, w in zip(mod.run(*args), ref.run(*args), strict=True):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
    assert len(launches) == 3
