"""python -m kernelarc +task=NAME [gpu=...] [agents.count=...] ...: one search session (or -m for a sweep)."""

from __future__ import annotations

import json
import logging

import hydra
from omegaconf import DictConfig

from kernelarc.config import register_configs

register_configs()


@hydra.main(version_base=None, config_path="../conf", config_name="config")
def main(cfg: DictConfig) -> dict:
    from kernelarc.app import TaskError, UsageError, fail, resolve_gpu, typed
    from kernelarc.config import plain
    from kernelarc.session import SessionFailed
    from kernelarc.ui import Progress

    logging.getLogger("kernelarc").setLevel(logging.INFO)
    import multiprocessing

    if multiprocessing.get_start_method(allow_none=True) == "loky":
        # a hydra/launcher=kernelarc_joblib job: processes the guard starts must not inherit loky's method
        multiprocessing.set_start_method("spawn", force=True)
    try:
        c = typed(cfg)
        target = resolve_gpu(c)
        from kernelarc.wiring import build_session  # the task is loaded once, for the agents and the guards

        session = build_session(c, plain(cfg), target)
        summary = session.run()
    except (UsageError, TaskError) as e:
        fail(str(e))
        return {}
    except SessionFailed as e:  # recorded in the state folder and as a FAILED MLflow run
        fail(f"search failed: {e.reason}", code=1)
        return {}
    from kernelarc.ui import next_steps

    session.ui.close()  # the live bar ends before the table
    ui = Progress(True)
    rows = [(k, v) for k, v in summary.items() if not isinstance(v, dict)]
    rows.append(("by_status", json.dumps(summary["by_status"])))
    rows.append(("phase_mean_s", json.dumps(summary["phase_mean_s"])))
    ui.summary(rows, next_steps(c, summary, getattr(session.tracker, "experiment_id", None)))
    return summary


if __name__ == "__main__":
    main()
