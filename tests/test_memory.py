"""The guard's memory plan: bounded seeds, cache, float64 reference and workers; verdicts where nothing fits."""

import json
from pathlib import Path

import pytest
import torch

from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.guard.memory import GB, Footprint, dry_run, io_sizes, max_parallel, memory_plan, plan_memory
from kernelarc.models import Status, Verdict
from kernelarc.tasks import load_task
from kernelarc.tasks.inputs import load_module

REFERENCE = """import torch

def run(x):
    # a working set four times the output: the dry run must see more than the definition's sizes
    t = torch.cat([x, x, x, x], dim=1)
    return (t * 2.0).sum(dim=1).unsqueeze(1).expand_as(x).contiguous()
"""


def _problem(tmp_path: Path, sizes=(16, 4096)) -> Path:
    d = {
        "name": "memory_probe",
        "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": 1024}},
        "inputs": {"x": {"shape": ["M", "N"], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["M", "N"], "dtype": "float32"}},
        "reference": REFERENCE,
    }
    (tmp_path / "definition.json").write_text(json.dumps(d))
    wls = [{"uuid": f"m{m}", "axes": {"M": m}, "inputs": {"x": {"type": "random"}}} for m in sizes]
    (tmp_path / "workload.jsonl").write_text("\n".join(json.dumps(w) for w in wls))
    return tmp_path


def _fp(i: int, mb_in: float, mb_out: float, mb_peak: float) -> Footprint:
    mb = 1 << 20
    return Footprint(i, int(mb_in * mb), int(mb_out * mb), int(mb_out * mb) // 2, int(mb_peak * mb), measured=True)


def test_sizes_come_from_the_definition(tmp_path):
    t = load_task(_problem(tmp_path))
    assert io_sizes(t, 1) == (4096 * 1024 * 4, 4096 * 1024 * 4, 4096 * 1024)
    fp = dry_run(t, 0, "cpu", load_module(t.definition.reference, "memory_probe").run)
    assert fp.error is None and fp.peak_bytes >= fp.output_bytes == 16 * 1024 * 4


def test_a_reference_above_the_cap_gets_a_verdict_with_its_cause(tmp_path):
    t = load_task(_problem(tmp_path))
    run = load_module(t.definition.reference, "memory_probe").run
    plan = plan_memory(t, [0, 1], "cpu", memory_gb=0.02, run=run)  # 20 MB: workload 1 moves 32 MB
    assert plan.runnable == [0]
    assert "inputs and outputs alone take 0.03 GB, above the cap" in plan.verdicts[1]
    assert any("workload 1 not run" in w for w in plan.warnings())
    tiny = plan_memory(t, [0, 1], "cpu", memory_gb=1e-5, run=run)
    assert tiny.runnable == [] and len(tiny.errors()) == 2


def test_the_plan_bounds_workers_seeds_and_float64_before_giving_up():
    fps = {0: _fp(0, 2000, 2000, 4000), 1: _fp(1, 200, 200, 400)}  # MB; on a GPU (flush buffer, contexts)

    def plan(gb, f=fps):
        return plan_memory(None, list(f), "cuda:0", memory_gb=gb, seeds=3, parallel=3, footprints=f)

    big = plan(141)
    assert big.runnable == [0, 1] and big.seeds == 3 and big.max_workers == 3 and big.ref_cache_entries == 16
    assert big.need_bytes <= 141 * GB * 0.9
    assert plan(141, {0: _fp(0, 100, 100, 200)}).hp_reference  # float64 where it fits ...
    assert not big.hp_reference  # ... and not where it would take the room of the workers
    mid = plan(80)
    assert mid.seeds == 3 and mid.max_workers == 1 and any("worker(s) in flight" in n for n in mid.notes)
    small = plan(40)
    assert small.runnable == [0, 1] and small.seeds == 1 and any("seed(s) per workload" in n for n in small.notes)
    assert small.need_bytes <= 40 * GB * 0.9
    # workload 0 fits alone in 30 GB, not beside workload 1's sets: it goes, with the cause
    both = plan(30)
    assert both.runnable == [1] and "not beside the other workloads" in both.verdicts[0]
    # workload 0's reference fits in 16 GB (6 GB), the guard around it (judge + worker) does not
    tight = plan(16)
    assert tight.runnable == [1] and "the reference fits (5.86 GB) but the guard needs" in tight.verdicts[0]


def test_the_champions_worker_beside_the_challengers_is_planned_with_its_own_input_sets():
    """L2/024 on the H100 (input sets of 12 GB, 16 GB for one reference call): planned without the champion's
    worker, the guard fitted a 70 GB cap, and its timing beside the champion ran out of the card's memory."""
    fps = {1: _fp(1, 12_300, 16, 3_700), 13: _fp(13, 12_400, 64, 4_000)}

    def plan(gb, champion=True):
        return plan_memory(None, [1, 13], "cuda:0", memory_gb=gb, footprints=fps, champion=champion)

    alone = plan(70, champion=False)  # the run's plan: one seed, one worker, no float64 reference
    assert alone.runnable == [1, 13] and alone.seeds == 1 and alone.max_workers == 1
    beside = plan(70)  # with the champion's worker: neither workload fits one input set under the cap
    assert beside.runnable == []
    assert all("and the champion's worker beside it" in v for v in beside.verdicts.values())
    h200 = plan(135)  # an H200's share: both fit, one input set each, beside the champion
    assert h200.runnable == [1, 13] and h200.seeds == 1 and h200.max_workers == 1
    assert plan(135, champion=False).seeds == 3  # the room the champion's sets take would have gone to seeds


def test_the_guard_runs_what_fits_and_records_the_rest(tmp_path):
    task = load_task(_problem(tmp_path))
    cfg = GuardConfig(timeout_s=60, target_ms=2, min_iters=2, max_iters=4, prestart=1, memory_gb=0.02)
    with Guard(task, None, "cpu", cfg) as g:
        ev = g.evaluate(reference_candidate(task), trusted=True)
        v = ev.verdict
        assert v.correct, v.errors
        assert [w.index for w in v.workloads] == [0]
        assert any("workload 1 not run" in w and "above the cap" in w for w in v.warnings)
        assert list(v.workloads_not_run) == [1] and "above the cap" in v.workloads_not_run[1]
        assert Verdict.model_validate_json(v.model_dump_json()).workloads_not_run == v.workloads_not_run
        assert max_parallel(g, 3) >= 1
    cfg.memory_gb = 1e-5
    with Guard(task, None, "cpu", cfg) as g:
        v = g.evaluate(reference_candidate(task), trusted=True).verdict
        assert v.status is Status.runtime_error and any("above the cap" in e for e in v.errors)
        assert sorted(v.workloads_not_run) == [0, 1]  # an early verdict names them too
        assert memory_plan(g) is memory_plan(g)  # made once


@pytest.mark.gpu
def test_dry_run_measures_the_peak_on_a_gpu(tmp_path):
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    t = load_task(_problem(tmp_path))
    fp = dry_run(t, 1, "cuda:0", load_module(t.definition.reference, "memory_probe").run)
    assert fp.measured and fp.peak_bytes >= 4 * fp.input_bytes  # the cat's working set


@pytest.mark.gpu
def test_dry_run_is_bounded_by_its_cap_on_a_gpu(tmp_path):
    """Processes sharing a GPU plan from these probes: a probe may not take more than its cap (run DT, H100: an
    unbounded one held 46.7 GB under an 11 GB share). Out of memory under the bound reads as over_cap; the
    process's allocator fraction is restored after it."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no GPU")
    t = load_task(_problem(tmp_path, sizes=(16, 65536)))  # workload 1: 256 MB in, a 1 GB cat, 256 MB out
    run = load_module(t.definition.reference, "memory_probe").run
    free = dry_run(t, 1, "cuda:0", run)
    assert free.measured and free.error is None and free.peak_bytes >= 4 * free.input_bytes
    tight = dry_run(t, 1, "cuda:0", run, cap_bytes=free.input_bytes + free.output_bytes + (64 << 20))
    assert tight.over_cap and "within the cap" in (tight.error or ""), tight.error
    roomy = dry_run(t, 1, "cuda:0", run, cap_bytes=free.input_bytes + free.peak_bytes + (256 << 20))
    assert roomy.error is None and roomy.measured
    assert torch.cuda.get_per_process_memory_fraction(0) == 1.0
    big = torch.empty(int(free.input_bytes + 2 * free.peak_bytes), dtype=torch.uint8, device="cuda:0")
    del big  # the bound is gone: more than any cap above is allocated


def test_a_worker_draws_the_next_staged_set_after_dropping_the_last():
    """A checked burst's staged inputs are drawn anew before every such burst; drawn while the last set was still
    held, two were alive at once, one input set more than the plan counts (12 GB for L2/024 on the H100)."""
    from types import SimpleNamespace

    from kernelarc.guard.worker import Harness

    held_while_drawing = []

    def draw(task, wl, seed, device):
        held_while_drawing.append(sorted(h.staged))
        return [f"set {wl}/{seed}"]

    h = SimpleNamespace(staged={3: ["set 3/1"], 5: ["set 5/1"]}, fresh={3}, task=None, device="cpu", make_inputs=draw)
    Harness.do_stage(h, 3, 2)
    assert held_while_drawing == [[5]]  # workload 3's last set was gone; another workload's is not this call's
    assert h.staged == {3: ["set 3/2"], 5: ["set 5/1"]} and h.fresh == {3}


def test_a_problem_drawn_by_its_own_get_inputs_is_planned_with_a_redrawn_set_in_every_worker():
    """Its timed calls get whole new draws of its inputs (the worker's ``_redraw``): a transient input set more in
    every challenger's worker and in the champion's."""
    from types import SimpleNamespace

    def task(kind):
        return SimpleNamespace(name="t", workloads=[SimpleNamespace(inputs={"x": SimpleNamespace(type=kind)})])

    fps = {0: _fp(0, 1_000, 10, 100)}

    def need(kind, workers):
        p = plan_memory(task(kind), [0], "cuda:0", memory_gb=200, footprints=fps, seeds=1, parallel=workers)
        assert p.max_workers == workers and p.seeds == 1
        return p.need_bytes

    for workers in (1, 2):
        assert need("custom", workers) - need("random", workers) == (workers + 1) * fps[0].input_bytes


def test_a_workload_without_room_for_a_new_draw_runs_with_its_timed_calls_repeating_one_content():
    """L2/024's sets are 13 GB: a new draw before every timed call is one more in the challenger's worker and one in
    the champion's. Where that does not fit the cap but the workload does without it, the workload runs and its
    timed calls repeat one content (the rule on checked calls guards them); a dear draw is never planned for."""
    from types import SimpleNamespace

    task = SimpleNamespace(name="t", workloads=[SimpleNamespace(inputs={"x": SimpleNamespace(type="custom")})])
    fps = {0: _fp(0, 12_000, 100, 1_000), 1: _fp(1, 100, 10, 100)}
    roomy = plan_memory(task, [0, 1], "cuda:0", memory_gb=200, footprints=fps, seeds=1)
    assert roomy.runnable == [0, 1] and roomy.redraw == {0, 1}
    tight = plan_memory(task, [0], "cuda:0", memory_gb=75, footprints={0: fps[0]}, seeds=1)
    assert tight.runnable == [0] and tight.redraw == set(), tight.verdicts
    assert any("repeat one content" in n for n in tight.notes), tight.notes
    fps[1].draw_s = 0.2  # 200 ms a draw: dearer than guard.fresh_inputs_ms
    dear = plan_memory(task, [1], "cuda:0", memory_gb=200, footprints={1: fps[1]}, seeds=1)
    assert dear.runnable == [1] and dear.redraw == set()


SEED_BLIND = """import torch

def get_inputs(axes, device):
    n = axes["N"]
    return {"pos": torch.arange(n, device=device), "scale": torch.full((n,), 0.5, device=device)}

def run(pos, scale):
    if not torch.equal(pos, torch.arange(pos.numel(), device=pos.device)):
        raise ValueError("positions must be 0..n-1")  # a reference that takes its own inputs only
    return pos.float() * scale
"""


def test_a_reference_that_fails_on_scaled_draws_keeps_the_problems_own(tmp_path):
    """Inputs that ignore their seed are scaled and permuted on most seeds (inputs._jitter); where the reference fails
    on such a draw (the dry run tries one), the task's draws stay as its get_inputs makes them, in the judge and, by
    the job, in its workers."""
    from kernelarc.tasks.inputs import JITTER_OFF, jitter_changes, make_inputs

    d = {
        "name": "seed_blind_probe",
        "axes": {"N": {"type": "var"}},
        "custom_inputs_entrypoint": "get_inputs",
        "inputs": {"pos": {"shape": ["N"], "dtype": "int64"}, "scale": {"shape": ["N"], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["N"], "dtype": "float32"}},
        "reference": SEED_BLIND,
    }
    (tmp_path / "definition.json").write_text(json.dumps(d))
    wl = {"uuid": "a", "axes": {"N": 64}, "inputs": {"pos": {"type": "custom"}, "scale": {"type": "custom"}}}
    (tmp_path / "workload.jsonl").write_text(json.dumps(wl) + "\n")
    task = load_task(tmp_path, cpu=True)
    assert jitter_changes(task, 0, "cpu")
    assert not torch.equal(make_inputs(task, 0, 1, "cpu")[0], torch.arange(64))  # permuted before the dry run
    ref = load_module(SEED_BLIND, "seed_blind_ref")
    fp = dry_run(task, 0, "cpu", ref.run, None)
    assert fp.error is None and str(task.path) in JITTER_OFF
    for seed in range(4):
        pos, scale = make_inputs(task, 0, seed, "cpu")
        assert torch.equal(pos, torch.arange(64)) and bool((scale == 0.5).all())
    JITTER_OFF.discard(str(task.path))
