"""python -m kernelarc.export +task=NAME gpu=TARGET format=sol-execbench|python out=DIR [export.dps=false]

Writes the registry's champion (alias ``champion`` of ``kernelarc.<task>.<gpu>``) as a
SOL-ExecBench solution.json with its sources (destination-passing style, the harness's
default; ``export.dps=false`` for a value-returning entry point), or as a standalone Python
module.
"""

from __future__ import annotations

import hydra
from omegaconf import DictConfig

from kernelarc.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from kernelarc.app import UsageError, fail, typed
    from kernelarc.exporting import export_for_task
    from kernelarc.registry import Registry
    from kernelarc.wiring import load_task_from_config

    try:
        c = typed(cfg)
        if not c.out:
            raise UsageError("out=DIR is required")
        if c.format not in ("sol-execbench", "python"):
            raise UsageError(f"format must be sol-execbench or python, not {c.format!r}")
        gpu = c.gpu.get("name") if isinstance(c.gpu, dict) else str(c.gpu)
        if gpu in (None, "auto"):
            import torch

            from kernelarc.hardware import resolve_target

            gpu = resolve_target("auto").name if torch.cuda.is_available() else "cpu"
        task = load_task_from_config(c, gpu == "cpu")
        reg = Registry(c.tracking.uri, task.name, gpu)
        found = reg.champion()
        if found is None:
            raise UsageError(f"no champion registered for {task.name} on {gpu}: run a search first")
        version, cand, tags = found
        path = export_for_task(
            cand, task, hydra.utils.to_absolute_path(c.out), c.format, gpu, dps=c.export.dps,
            description=f"KernelArc champion v{version} ({cand.family or cand.language}) for {task.name} on {gpu}",
            metrics={k: v for k, v in tags.items() if not k.startswith("kernelarc.source")},
            provenance={"registry_version": version, "model": f"kernelarc.{task.name}.{gpu}"},
        )  # fmt: skip
    except UsageError as e:
        fail(str(e))
        return
    print(f"exported champion v{version} of kernelarc.{task.name}.{gpu} to {path}")


if __name__ == "__main__":
    main()
