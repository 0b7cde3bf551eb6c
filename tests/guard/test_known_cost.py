"""The candidate's timeout is for the candidate: the judge's reference outputs and the champion's own calls come on
top (Guard.known_cost_s). On the H200, L1/094's reference takes 10 s a call, and every challenger beside it timed
out on the champion's side within its 40 s ("champion worker failed ... not compared"), though it took 0.5 ms."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from test_consistency import FAST

from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.guard.settings import GuardSettings
from kernelarc.models import Candidate, Status
from kernelarc.tasks.loader import load_task

ROOT = Path(__file__).resolve().parents[2]
RMSNORM = ROOT / "kernelarc" / "tasks" / "builtin" / "rmsnorm"
SLEEP_S = 0.4


def _known(baseline_ms: float, champion_ms: float | None, seeds: int = 3) -> float:
    g = SimpleNamespace(cfg=GuardSettings(), workloads=[0], baseline_ms={0: baseline_ms})
    return Guard.known_cost_s(g, None if champion_ms is None else {0: champion_ms}, seeds)


def test_the_known_cost_is_milliseconds_on_ordinary_problems_and_minutes_behind_a_slow_reference():
    assert _known(0.2, 0.05) < 0.5  # a 0.2 ms reference, a 0.05 ms champion
    # L1/094: a 10 s reference as the champion: its calls and the judge's reference outputs, re-timings included
    slow = _known(10_000.0, 10_000.0, seeds=1)
    assert slow > 10 * (1 + 3 * 3) * 1.5  # the judge's reference alone: 10 calls of 10 s, half again for slack
    assert _known(10_000.0, None, seeds=1) < slow  # no champion beside it: the judge's share only


def test_a_fast_challenger_beside_a_slow_reference_is_compared_not_timed_out(tmp_path):
    d = json.loads((RMSNORM / "definition.json").read_text())
    ref = d["reference"].replace("import torch\n", "import time\n\nimport torch\n", 1)
    ref = ref.replace("def run(x, weight):\n", f"def run(x, weight):\n    time.sleep({SLEEP_S})\n", 1)
    assert f"time.sleep({SLEEP_S})" in ref
    (tmp_path / "definition.json").write_text(json.dumps(dict(d, name="slow_rmsnorm", reference=ref)))
    wl = {"uuid": "s-0", "axes": {"M": 8, "N": 64}, "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}}}
    (tmp_path / "workload.jsonl").write_text(json.dumps(wl) + "\n")
    task = load_task(tmp_path, cpu=True)
    timeout_s = 2.0  # far less than the judge's reference outputs and the champion's calls take beside a challenger
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=timeout_s, target_ms=5, min_iters=3, max_iters=20, prestart=2))
    try:
        crowned = g.evaluate(reference_candidate(task), trusted=True, timeout_s=60)
        assert crowned.verdict.status is Status.champion, crowned.verdict.errors
        g.set_baselines(crowned, None)
        lat = {w.index: w.latency_ms for w in crowned.verdict.workloads}
        assert min(lat.values()) >= SLEEP_S * 1e3
        assert g.known_cost_s(lat, len(g.workloads) and 3) > 2 * timeout_s
        v = g.evaluate(Candidate(source=FAST, language="pytorch"), reference_candidate(task),
                       champion_reference=lat).verdict  # fmt: skip
        assert v.status is Status.champion, (v.status, v.errors, v.warnings)
        assert not any("not compared" in w for w in v.warnings), v.warnings
    finally:
        g.close()
