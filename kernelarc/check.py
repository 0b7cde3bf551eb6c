"""python -m kernelarc.check +task=NAME kernel=FILE [gpu=...] [language=...]: one JSON verdict.

The kernel is judged by the guard against the task's reference (baseline T_b and,
unless guard.compile_baseline=false, torch.compile of it, measured in the same run); it
is "champion" if correct and faster than the reference side by side. Exits 0 whatever
the kernel's verdict; 1 when the task's reference itself fails (it does not import, has no
``run``, raises or runs out of memory: the kernel cannot be judged, and is not blamed);
2 for misuse (missing file, unknown task, bad config).
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import hydra
from omegaconf import DictConfig

from kernelarc.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from kernelarc.app import TaskError, UsageError, fail, resolve_gpu, typed
    from kernelarc.guard.judge import Guard, compiled_candidate, detect_language, reference_candidate
    from kernelarc.models import Candidate
    from kernelarc.wiring import devices_for, guard_settings, load_task_from_config, reference_problem

    logging.getLogger("kernelarc").setLevel(logging.WARNING)
    # stdout carries the JSON verdict alone: the console log (hydra/job_logging: stdout) goes to stderr here (a real
    # problem's "workload 4 (127 MB) shrunk for the CPU" warnings came before the JSON and broke its parse)
    for h in logging.getLogger().handlers:
        if isinstance(h, logging.StreamHandler) and getattr(h, "stream", None) is sys.stdout:
            h.setStream(sys.stderr)
    try:
        c = typed(cfg)
        if not c.kernel:
            raise UsageError("kernel=FILE is required")
        path = Path(hydra.utils.to_absolute_path(c.kernel))
        if not path.is_file():
            raise UsageError(f"kernel file not found: {path}")
        source = path.read_text()
        language = c.language or detect_language(source)
        if language not in ("triton", "cutlass", "pytorch"):
            raise UsageError(f"language must be triton, cutlass or pytorch, not {language!r}")
        target = resolve_gpu(c)
        device = devices_for(target, c)[0]
        task = load_task_from_config(c, device == "cpu")
    except (UsageError, TaskError) as e:
        fail(str(e))
        return
    problem = reference_problem(task)
    if problem is not None:
        fail(f"cannot judge the kernel: {problem}", code=1)
        return
    gcfg = guard_settings(c, task, device == "cpu")
    cand = Candidate(source=source, language=language, agent="user", strategy="check")
    with Guard(task, target, device, gcfg, seed=c.seed) as guard:
        ref = guard.evaluate(reference_candidate(task), trusted=True, timeout_s=c.guard.baseline_timeout_s)
        if not ref.verdict.correct:
            why = "; ".join(e.splitlines()[0][:300] for e in ref.verdict.errors) or "no error message"
            fail(f"cannot judge the kernel: the task's reference failed ({ref.verdict.status.value}): {why}", code=1)
            return
        comp = None
        if c.guard.compile_baseline:
            comp = guard.evaluate(compiled_candidate(task), trusted=True, timeout_s=c.guard.baseline_timeout_s)
        guard.set_baselines(ref, comp)
        ev = guard.evaluate(cand, reference_candidate(task))
    out = ev.verdict.model_dump(mode="json")
    out.update(
        {
            "task": task.name,
            "gpu": target.name,
            "device": device,
            "language": language,
            "kernel": str(path),
            "baseline_ms": {str(k): v for k, v in guard.baseline_ms.items()},
            "compile_ms": {str(k): v for k, v in guard.compile_ms.items()},
            "task_warnings": task.warnings,
        }
    )
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
