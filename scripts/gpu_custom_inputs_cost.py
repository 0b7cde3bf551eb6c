"""What fresh inputs per timed call would cost on the problems whose inputs all come from the problem's own
``get_inputs`` (the red team's c02: unchecked timed calls repeat one content there, so a memo on it pays). For each
such problem under TREE: the median seconds of ``make_inputs`` on the GPU over 3 fresh seeds, on its smallest and
largest workload, beside the size of the set. Prints one line per problem, then a summary.

    python3 scripts/gpu_custom_inputs_cost.py .shared/sol-execbench [DEVICE]
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

from kernelarc.tasks.inputs import input_bytes, make_inputs
from kernelarc.tasks.loader import load_task


def _seconds(task, wl: int, device: str) -> float:
    make_inputs(task, wl, 1, device)  # first call: the reference module's import, lazy CUDA set-up
    times = []
    for seed in (2, 3, 4):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t = time.perf_counter()
        make_inputs(task, wl, seed, device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> None:
    tree = Path(sys.argv[1])
    device = sys.argv[2] if len(sys.argv) > 2 else ("cuda:0" if torch.cuda.is_available() else "cpu")
    rows = []
    for d in sorted(p.parent for p in tree.glob("*/*/definition.json")):
        try:
            task = load_task(d)
        except Exception as e:  # noqa: BLE001 - a problem that does not load is reported, not fatal
            print(f"{d.name}: does not load: {e}", flush=True)
            continue
        if {x.type for x in task.workloads[0].inputs.values()} != {"custom"}:
            continue
        sizes = sorted(range(len(task.workloads)), key=lambda k: input_bytes(task, k))
        for wl in dict.fromkeys((sizes[0], sizes[-1])):
            try:
                s = _seconds(task, wl, device)
            except Exception as e:  # noqa: BLE001
                print(f"{d.parent.name}/{d.name[:40]} wl{wl}: failed: {type(e).__name__}: {e}", flush=True)
                continue
            rows.append((f"{d.parent.name}/{d.name[:40]}", wl, input_bytes(task, wl) / 1e6, s * 1e3))
            print(f"{rows[-1][0]:50} wl{wl:<3} {rows[-1][2]:10.2f} MB {rows[-1][3]:10.2f} ms", flush=True)
    if rows:
        ms = [r[3] for r in rows]
        print(f"{len(rows)} workloads on {device}: median {statistics.median(ms):.2f} ms, max {max(ms):.2f} ms")


if __name__ == "__main__":
    main()
