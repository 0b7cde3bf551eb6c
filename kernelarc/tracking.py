"""MLflow tracking: one parent run per search session, one nested child run per candidate.

Names are the DESIGN.md contract ("Tracking and registry (MLflow)"):

- experiment ``kernelarc/<task>/<gpu>``;
- parent run: the whole composed config as flattened params (secrets redacted);
- child run ``<agent>:<candidate_id>``: params ``agent``, ``strategy``, ``language``,
  ``family``, ``parent``, ``knob.<name>``; metrics ``correct``, ``latency_ms``,
  ``tflops``/``tbps``, ``sol_fraction``, ``sol_score``, ``speedup_vs_baseline`` (plus
  ``speedup_vs_compile``, ``speedup_vs_champion``, ``noise``, ``eval_seconds``,
  ``phase.<name>_s`` and ``wl<i>.<metric>`` where present); tags ``kernelarc.verdict``,
  ``kernelarc.agent``, ``kernelarc.strategy``, ``kernelarc.language``,
  ``kernelarc.candidate_id``; artifacts ``kernel/kernel.py``, ``kernel/verdict.json``,
  ``kernel/candidate.json``.

``MlflowClient`` is used directly (no fluent global state, so several trackers can live in one
process) and each child run costs four store calls: create_run, one log_batch, log_artifacts,
set_terminated.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kernelarc.models import Candidate, Verdict

log = logging.getLogger(__name__)

# MLflow draws a progress bar per artifact download (the registry's champion, a resumed run's files): on a
# session's console that is noise between verdict lines. A user who wants it sets the variable to true.
os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")

REDACTED = "***REDACTED***"
MAX_PARAM_VAL = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
MAX_TAG_VAL = 8000  # MAX_TAG_VAL_LENGTH
MAX_KEY = 250  # MAX_ENTITY_KEY_LENGTH
MAX_PER_BATCH = 100  # MAX_PARAMS_TAGS_PER_BATCH (params and tags each); metrics allow 1000
PARENT_TAG = "mlflow.parentRunId"
CANDIDATE_ARTIFACT_DIR = "kernel"
# MLflow 3's UI opens an experiment in its GenAI (traces) view unless this tag says otherwise.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
# Saved runs-table views (the UI's "share view" state) that ui_url() opens, with the columns a user
# compares: the sessions (candidates nested under each), and every candidate of every session, fastest first.
VIEW_KEY = "kernelarc"
CANDIDATES_VIEW_KEY = "kernelarc-candidates"
VIEW_TAG_PREFIX = "mlflow.sharedViewState."
VIEW_TAG = VIEW_TAG_PREFIX + VIEW_KEY
VIEW_COLUMNS = (
    "attributes.`Duration`",
    "tags.`kernelarc.verdict`",
    "params.`family`",
    "params.`agent`",
    "metrics.`latency_ms`",
    "metrics.`tflops`",
    "metrics.`tbps`",
    "metrics.`sol_fraction`",
    "metrics.`speedup_vs_baseline`",
    "metrics.`speedup_vs_compile`",
    "metrics.`speedup_vs_champion`",
    "metrics.`evaluated`",
    "params.`agents.count`",
    "params.`memory.limit`",
)

# "token" but not "max_tokens"/"tokenizer": token budgets are config worth keeping.
_SECRET_KEY_RE = re.compile(r"api[_-]?key|token(?!s|iz)|secret|passw(or)?d|credential", re.IGNORECASE)
_SECRET_VALUE_RE = re.compile(r"sk-ant-[A-Za-z0-9_\-]*")
_BAD_NAME_CHARS = re.compile(r"[^\w.\- /]")
# Only these are candidate-level summary metrics; per-workload ones get a wl<i>. prefix.
_VERDICT_METRICS = (
    "latency_ms",
    "tflops",
    "tbps",
    "sol_fraction",
    "sol_score",
    "speedup_vs_baseline",
    "speedup_vs_compile",
    "speedup_vs_champion",
    "noise",
    "eval_seconds",
)
_WORKLOAD_METRICS = (
    "latency_ms",
    "tflops",
    "tbps",
    "sol_fraction",
    "sol_score",
    "speedup_vs_baseline",
    "speedup_vs_compile",
    "noise",
    "t_sol_ms",
    "baseline_ms",
    "compile_ms",
    "max_abs_err",
    "rel_err",
    "matched_ratio",
)


# --------------------------------------------------------------------------- secrets


def _env_secrets() -> list[str]:
    """Values of secret-looking environment variables (ANTHROPIC_API_KEY first).

    Read at every call so a key set after import is still caught. Short values are ignored:
    replacing a 3-character "token" everywhere would corrupt unrelated text.
    """
    values = []
    key = os.environ.get("ANTHROPIC_API_KEY", "")
    if key:
        values.append(key)
    # Other threads (MLflow's telemetry) set and delete variables while we read: take a snapshot of
    # the names, retrying if the mapping changes under us, and skip names gone by the time we look.
    for _ in range(5):
        try:
            names = list(os.environ)
            break
        except RuntimeError:  # dictionary changed size during iteration
            continue
    else:
        names = []
    for name in names:
        value = os.environ.get(name)
        if value and name != "ANTHROPIC_API_KEY" and _SECRET_KEY_RE.search(name) and len(value) >= 12:
            values.append(value)
    return sorted(set(values), key=len, reverse=True)


def scrub_text(text: str, secrets: list[str] | None = None) -> str:
    """Replace every known secret value and anything shaped like an Anthropic key.

    ``secrets`` (from ``_env_secrets()``) lets a caller scrubbing many strings scan the
    environment once."""
    for secret in _env_secrets() if secrets is None else secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return _SECRET_VALUE_RE.sub(REDACTED, text)


def is_secret_key(key: str) -> bool:
    return bool(_SECRET_KEY_RE.search(key))


def redact(obj: Any, *, _key: str = "", _force: bool = False) -> Any:
    """Deep copy of a config with secrets replaced by ``REDACTED``.

    A value is redacted when its key looks secret (api_key, token, secret, password, also every
    leaf below such a key) or when the value itself carries a secret (the ANTHROPIC_API_KEY
    value, any secret-named environment variable's value, any ``sk-ant-`` string).
    """
    force = _force or bool(_key and is_secret_key(_key))
    if isinstance(obj, Mapping):
        return {scrub_text(str(k)): redact(v, _key=str(k), _force=force) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, _force=force) for v in obj]
    if force and obj is not None and obj != "":
        return REDACTED
    if isinstance(obj, str):
        return scrub_text(obj)
    return obj


# --------------------------------------------------------------------------- helpers


def _to_container(config: Any) -> Any:
    """Plain dicts/lists from an OmegaConf DictConfig (resolved when possible), else as is."""
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf
    except ImportError:  # pragma: no cover - omegaconf is a declared dependency
        return config
    if isinstance(config, (DictConfig, ListConfig)):
        try:
            return OmegaConf.to_container(config, resolve=True)
        except Exception:  # a missing env interpolation must not kill tracking
            return OmegaConf.to_container(config, resolve=False)
    return config


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists stay values."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, name))
        else:
            out[name] = value
    return out


def _fmt_value(value: Any) -> str:
    """Params are strings; non-strings are JSON so None/bools read as in YAML."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, default=str)
    except (TypeError, ValueError):
        return str(value)


def sanitize_key(key: str) -> str:
    """A valid MLflow param/metric/tag key: allowed characters, normalized path, <=250 chars."""
    key = _BAD_NAME_CHARS.sub("_", str(key)).strip().strip("/")
    key = re.sub(r"/+", "/", key)
    key = "/".join("_" if part in (".", "..") else part for part in key.split("/")) or "_"
    if len(key) > MAX_KEY:
        import hashlib

        digest = hashlib.sha1(key.encode()).hexdigest()[:10]
        key = key[: MAX_KEY - 11] + "-" + digest
    return key


def _truncate(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def default_tracking_uri(cwd: str | os.PathLike | None = None) -> str:
    """``sqlite:///<cwd>/mlflow.db`` (the MLflow 3 default; the file store is refused)."""
    base = Path(cwd or os.getcwd()).resolve()
    return f"sqlite:///{base / 'mlflow.db'}"


def local_artifact_location(uri: str) -> str | None:
    """``mlartifacts/`` next to a SQLite file; ``None`` for servers (they own artifact storage)."""
    db_path = sqlite_path(uri)
    return None if db_path is None else (db_path.parent / "mlartifacts").resolve().as_uri()


def sqlite_path(uri: str) -> Path | None:
    """The database file of a ``sqlite:///`` URI, else ``None``."""
    if not uri.startswith("sqlite:///"):
        return None
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


def prepare_sqlite(uri: str) -> None:
    """Put a SQLite store in WAL mode (persistent in the file) before MLflow opens it.

    With the default rollback journal every commit costs several fsyncs (~120 ms per candidate
    here); WAL plus ``synchronous=NORMAL`` (see ``tune_store``) brings it to ~15 ms. WAL also
    lets readers (a UI, a second session) run while a session writes. It needs a local disk,
    not a network file system.
    """
    path = sqlite_path(uri)
    if path is None:
        return
    import sqlite3

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with sqlite3.connect(path, timeout=20) as conn:
            conn.execute("PRAGMA journal_mode=WAL").fetchall()
        conn.close()
    except sqlite3.Error as exc:  # a locked or read-only file: MLflow still works, only slower
        log.warning("could not switch %s to WAL mode: %s", path, exc)


@contextlib.contextmanager
def store_init_lock(uri: str):
    """Serialise MLflow's first open of a SQLite store across processes: two sessions of a parallel sweep
    starting on a new file would otherwise both run its schema migrations and one fails ("table
    _alembic_tmp_metrics already exists"). A BSD lock on the file itself, which SQLite's POSIX locks ignore."""
    path = sqlite_path(uri)
    if path is None:
        yield
        return
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "ab") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _sqlite_connect_pragmas(dbapi_conn, _record) -> None:
    # NORMAL in WAL mode: no fsync per commit; a power loss may drop the last commits,
    # an application crash loses nothing.
    cursor = dbapi_conn.cursor()
    cursor.execute("PRAGMA synchronous=NORMAL")
    cursor.close()


def tune_store(store: Any) -> None:
    """Apply the per-connection SQLite pragmas to an MLflow SQLAlchemy store's engine.

    MLflow caches one engine per URI for the whole process, so this is idempotent and affects
    every client of that URI. Best effort: if MLflow's internals change, logging is only slower.
    """
    engine = getattr(store, "engine", None)
    if engine is None or getattr(engine.dialect, "name", "") != "sqlite":
        return
    try:
        from sqlalchemy import event

        if not event.contains(engine, "connect", _sqlite_connect_pragmas):
            event.listen(engine, "connect", _sqlite_connect_pragmas)
            engine.dispose()  # pooled connections predate the listener
    except Exception as exc:  # pragma: no cover - defensive
        log.warning("could not tune the SQLite engine: %s", exc)


def checkpoint_sqlite(uri: str) -> None:
    """Fold the WAL into the main file so ``mlflow.db`` alone is a complete copy."""
    path = sqlite_path(uri)
    if path is None or not path.exists():
        return
    import sqlite3

    try:
        conn = sqlite3.connect(path, timeout=5)
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        conn.close()
    except sqlite3.Error as exc:
        log.debug("WAL checkpoint of %s skipped: %s", path, exc)


def experiment_name(task: str, gpu: str) -> str:
    return f"kernelarc/{task}/{gpu}"


def session_run_name(
    task: str, gpu: str, agents: int, memory: int | None, backend: str = "search", seed: int = 0
) -> str:
    """``rmsnorm-cpu-4a-m16``: what a sweep varies, readable in the runs table (``mall``: memory.limit=null).
    A non-default backend or seed is appended (``-anthropic``, ``-s1``)."""
    name = f"{task}-{gpu}-{agents}a-m{'all' if memory is None else memory}"
    if backend not in ("search", "auto"):
        name += f"-{backend}"
    if seed:
        name += f"-s{seed}"
    return name


def ui_url(experiment_id: str, base: str = "http://127.0.0.1:5000", view: str = VIEW_KEY) -> str:
    """The experiment's runs table (the UI's model-training mode) with KernelArc's saved columns
    (``VIEW_COLUMNS``); ``view=CANDIDATES_VIEW_KEY``: the candidates of all sessions, fastest first."""
    return (
        f"{base.rstrip('/')}/#/experiments/{experiment_id}/runs?workflowType=machine_learning&viewStateShareKey={view}"
    )


def _view_state(view: str) -> str:
    state: dict[str, Any] = {"selectedColumns": list(VIEW_COLUMNS)}
    if view == CANDIDATES_VIEW_KEY:  # parents have no candidate id: the candidates show flat
        state.update(
            searchFilter="tags.`kernelarc.candidate_id` LIKE '%'", orderByKey="metrics.`latency_ms`", orderByAsc=True
        )
    else:
        state.update(orderByKey="attributes.start_time", orderByAsc=False)
    return json.dumps(state)


def _chunks(items: list, size: int) -> Iterable[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


# --------------------------------------------------------------------------- tracker


class Tracker:
    """Logs a search session to MLflow. Thread-safe: writes are serialized by a lock."""

    def __init__(self, uri: str | None, task: str, gpu: str):
        if not task or not isinstance(task, str):
            raise ValueError(f"task must be a non-empty string, got {task!r}")
        if not gpu or not isinstance(gpu, str):
            raise ValueError(f"gpu must be a non-empty string, got {gpu!r}")
        from mlflow import MlflowClient

        self.task = task
        self.gpu = gpu
        self.uri = uri or default_tracking_uri()
        prepare_sqlite(self.uri)
        with store_init_lock(self.uri):  # the client's first open of a new file creates the schema
            self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
            tune_store(self.client._tracking_client.store)
        self.experiment_name = experiment_name(task, gpu)
        self.artifact_location = local_artifact_location(self.uri)
        self.experiment_id = self._ensure_experiment()
        self.parent_run_id: str | None = None
        self._lock = threading.Lock()
        self._seq = 0
        self._last_step = 0  # newest step of the session's metric series; the summary is logged there

    # -- setup ---------------------------------------------------------------

    def _ensure_experiment(self) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(self.experiment_name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self.client.restore_experiment(exp.experiment_id)
            # a store from an older KernelArc: classic view and saved views added
            if exp.tags.get(EXPERIMENT_KIND_TAG) != EXPERIMENT_KIND:
                self.client.set_experiment_tag(exp.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
            for view in (VIEW_KEY, CANDIDATES_VIEW_KEY):
                if VIEW_TAG_PREFIX + view not in exp.tags:
                    self.client.set_experiment_tag(exp.experiment_id, VIEW_TAG_PREFIX + view, _view_state(view))
            return exp.experiment_id
        try:
            return self.client.create_experiment(
                self.experiment_name,
                artifact_location=self.artifact_location,
                tags={
                    "kernelarc.task": self.task,
                    "kernelarc.gpu": self.gpu,
                    EXPERIMENT_KIND_TAG: EXPERIMENT_KIND,
                    VIEW_TAG: _view_state(VIEW_KEY),
                    VIEW_TAG_PREFIX + CANDIDATES_VIEW_KEY: _view_state(CANDIDATES_VIEW_KEY),
                },
            )
        except MlflowException:  # another process created it first
            exp = self.client.get_experiment_by_name(self.experiment_name)
            if exp is None:
                raise
            return exp.experiment_id

    def _require_session(self) -> str:
        if self.parent_run_id is None:
            raise RuntimeError("no session: call Tracker.start_session() first")
        return self.parent_run_id

    def _missing(self, run_id: str) -> bool:
        """True when the store has no run ``run_id`` (any other error is raised)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException as e:
            if getattr(e, "error_code", "") == "RESOURCE_DOES_NOT_EXIST":
                return True
            raise
        return False

    def _log_batch(self, run_id: str, params=(), metrics=(), tags=()) -> None:
        """log_batch honoring MLflow's per-call limits (one call in the common case)."""
        params, metrics, tags = list(params), list(metrics), list(tags)
        while params or metrics or tags:
            self.client.log_batch(
                run_id,
                params=params[:MAX_PER_BATCH],
                metrics=metrics[:1000],
                tags=tags[:MAX_PER_BATCH],
                synchronous=True,
            )
            params, metrics, tags = params[MAX_PER_BATCH:], metrics[1000:], tags[MAX_PER_BATCH:]

    @staticmethod
    def _unique(pairs: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """Sanitized keys can collide ("a b!" and "a b?"); MLflow rejects duplicate keys in a
        batch, so later ones get a ``__n`` suffix."""
        out: dict[str, Any] = {}
        for key, value in pairs:
            unique, n = key, 1
            while unique in out:
                n += 1
                unique = f"{key}__{n}"
            out[unique] = value
        return out

    @classmethod
    def _params(cls, items: Mapping[str, Any], keep_none: bool = False):
        """Candidate params skip None; config params keep it as "null" (memory.limit=null means
        "show everything", which is not the same as unset)."""
        from mlflow.entities import Param

        secrets = _env_secrets()
        pairs = cls._unique(
            (sanitize_key(scrub_text(str(k), secrets)), _truncate(scrub_text(_fmt_value(v), secrets), MAX_PARAM_VAL))
            for k, v in items.items()
            if keep_none or v is not None
        )
        return [Param(k, v) for k, v in pairs.items()]

    @classmethod
    def _tags(cls, items: Mapping[str, Any]):
        from mlflow.entities import RunTag

        secrets = _env_secrets()
        pairs = cls._unique(
            (sanitize_key(scrub_text(str(k), secrets)), _truncate(scrub_text(_fmt_value(v), secrets), MAX_TAG_VAL))
            for k, v in items.items()
            if v is not None
        )
        return [RunTag(k, v) for k, v in pairs.items()]

    @classmethod
    def _metrics(cls, items: Mapping[str, Any], step: int = 0, timestamp: int | None = None):
        from mlflow.entities import Metric

        ts = timestamp if timestamp is not None else int(time.time() * 1000)
        values = []
        for k, v in items.items():
            if v is None:
                continue
            if isinstance(v, bool):
                v = int(v)
            try:
                values.append((sanitize_key(k), float(v)))
            except (TypeError, ValueError):
                log.debug("skipping non-numeric metric %s=%r", k, v)
        return [Metric(k, v, ts, step) for k, v in cls._unique(values).items()]

    # -- session -------------------------------------------------------------

    def start_session(
        self, config: Mapping[str, Any] | Any, run_name: str | None = None, resume_run_id: str | None = None
    ) -> str:
        """Open the parent run (or reopen ``resume_run_id``) and log the config as params."""
        if self.parent_run_id is not None:
            raise RuntimeError(f"session {self.parent_run_id} is still open: call end_session() first")
        flat = flatten(redact(_to_container(config) or {}))
        with self._lock:
            lost = None
            if resume_run_id and self._missing(resume_run_id):
                # The state folder outlived its store (a store on a machine's /tmp, a deleted mlflow.db):
                # the session resumes from its own state under a new run that names the one it lost.
                log.warning("MLflow run %s of the saved session is not in %s: resuming under a new run",
                            resume_run_id, self.uri)  # fmt: skip
                lost, resume_run_id = resume_run_id, None
            if resume_run_id:
                run = self.client.get_run(resume_run_id)
                if run.info.experiment_id != self.experiment_id:
                    raise ValueError(
                        f"run {resume_run_id} belongs to experiment {run.info.experiment_id}, "
                        f"not {self.experiment_name} ({self.experiment_id})"
                    )
                self.client.update_run(resume_run_id, status="RUNNING")
                existing = run.data.params
                new_params = {}
                changed = {}
                for param in self._params(flat, keep_none=True):
                    if param.key not in existing:
                        new_params[param.key] = param.value
                    elif existing[param.key] != param.value:
                        changed[param.key] = param.value  # params are immutable in MLflow
                resumes = int(run.data.tags.get("kernelarc.resumes", "0")) + 1
                tags = {"kernelarc.resumes": resumes}
                if changed:
                    tags[f"kernelarc.resume{resumes}.config_changes"] = json.dumps(changed, sort_keys=True)
                self._log_batch(resume_run_id, params=self._params(new_params), tags=self._tags(tags))
                self.parent_run_id = resume_run_id
                self._seq = len(self.find_candidate_runs(resume_run_id))
                self._last_step = max(
                    [m.step for m in self.client.get_metric_history(resume_run_id, "evaluated")], default=0
                )
                log.info("resumed session run %s (%d candidates logged before)", resume_run_id, self._seq)
                return resume_run_id

            run = self.client.create_run(
                self.experiment_id,
                run_name=run_name,
                tags={"kernelarc.kind": "session", "kernelarc.task": self.task, "kernelarc.gpu": self.gpu},
            )
            run_id = run.info.run_id
            tags = self._tags({"kernelarc.resumed_from_lost_run": lost}) if lost else []
            self._log_batch(run_id, params=self._params(flat, keep_none=True), tags=tags)
            self.parent_run_id = run_id
            self._seq = 0
            self._last_step = 0
            return run_id

    def log_candidate(
        self,
        candidate: Candidate,
        verdict: Verdict,
        extra_metrics: Mapping[str, Any] | None = None,
        started: float | None = None,
        ended: float | None = None,
    ) -> str:
        """One nested child run for a judged candidate; returns its run id.

        ``started``/``ended`` (``time.time()`` seconds) are the evaluation's real start and end: the run's
        start and end times, so its duration in the UI is the evaluation's. Without them the run ends now
        and starts ``verdict.eval_seconds`` earlier."""
        parent = self._require_session()
        cid = candidate.id
        if verdict.candidate_id != cid:
            log.warning("verdict is for candidate %s but candidate id is %s", verdict.candidate_id, cid)

        params: dict[str, Any] = {
            "agent": candidate.agent,
            "strategy": candidate.strategy,
            "language": candidate.language,
            "family": candidate.family,
            "parent": candidate.parent,
        }
        for name, value in candidate.knobs.items():
            params[f"knob.{name}"] = value

        metrics: dict[str, Any] = {"correct": 1 if verdict.correct else 0}
        for name in _VERDICT_METRICS:
            metrics[name] = getattr(verdict, name)
        for phase, seconds in verdict.phases.items():
            metrics[f"phase.{phase}_s"] = seconds
        for wl in verdict.workloads:
            prefix = f"wl{wl.index}."
            metrics[prefix + "correct"] = 1 if wl.correct else 0
            for name in _WORKLOAD_METRICS:
                metrics[prefix + name] = getattr(wl, name)
        for name, value in (extra_metrics or {}).items():
            metrics[name] = value

        tags: dict[str, Any] = {
            "kernelarc.verdict": verdict.status.value,
            "kernelarc.agent": candidate.agent,
            "kernelarc.strategy": candidate.strategy,
            "kernelarc.language": candidate.language,
            "kernelarc.candidate_id": cid,
            "kernelarc.family": candidate.family,
            "kernelarc.rationale": candidate.rationale or None,
            "kernelarc.error": verdict.errors[0] if verdict.errors else None,
        }

        cand_meta = candidate.model_dump(mode="json", exclude={"source"})
        cand_meta["id"] = cid
        files = {
            "kernel.py": candidate.source,
            "verdict.json": verdict.model_dump_json(indent=2),
            "candidate.json": json.dumps(cand_meta, indent=2, default=str),
        }

        end_ms = int((ended if ended is not None else time.time()) * 1000)
        if started is not None:
            start_ms = min(int(started * 1000), end_ms)
        else:
            start_ms = end_ms - int((verdict.eval_seconds or 0.0) * 1000)
        with self._lock:
            step = self._seq
            self._seq += 1
            run = self.client.create_run(
                self.experiment_id,
                start_time=start_ms,
                run_name=f"{candidate.agent}:{cid}",
                tags={PARENT_TAG: parent},
            )
            run_id = run.info.run_id
            self._log_batch(
                run_id,
                params=self._params(params),
                metrics=self._metrics(metrics, step=step, timestamp=end_ms),
                tags=self._tags(tags),
            )
            self._write_artifacts(run, files)
            self.client.set_terminated(run_id, "FINISHED", end_time=end_ms)
        return run_id

    def _write_artifacts(self, run, files: Mapping[str, str]) -> None:
        """``kernel/<name>`` files of a run. A local (file:) artifact store is written in place,
        which is what MLflow's LocalArtifactRepository does after a copy; others get an upload."""
        secrets = _env_secrets()
        texts = {name: scrub_text(text, secrets) for name, text in files.items()}
        uri = run.info.artifact_uri
        if uri.startswith("file:"):
            from mlflow.utils.file_utils import local_file_uri_to_path

            kdir = Path(local_file_uri_to_path(uri)) / CANDIDATE_ARTIFACT_DIR
            kdir.mkdir(parents=True, exist_ok=True)
            for name, text in texts.items():
                (kdir / name).write_text(text)
            return
        with tempfile.TemporaryDirectory(prefix="kernelarc-art-") as tmp:
            kdir = Path(tmp) / CANDIDATE_ARTIFACT_DIR
            kdir.mkdir()
            for name, text in texts.items():
                (kdir / name).write_text(text)
            self.client.log_artifacts(run.info.run_id, str(kdir), CANDIDATE_ARTIFACT_DIR)

    def log_session_metrics(self, step: int, **metrics: Any) -> None:
        """Session-level time series on the parent run (best latency, candidates/min, ...)."""
        parent = self._require_session()
        with self._lock:
            self._last_step = max(self._last_step, int(step))
            self._log_batch(parent, metrics=self._metrics(metrics, step=int(step)))

    def log_best_so_far_plot(
        self,
        history: list[tuple[int, float]],
        champions: list[tuple[int, float]] | None = None,
        name: str = "best_so_far.png",
    ) -> str | None:
        """PNG of latency vs candidate index (lower is better): every correct candidate as a dot and
        the champion's latency as a staircase. ``champions`` are the (index, latency) points where the
        champion moved; without them the staircase is the running minimum of ``history``."""
        parent = self._require_session()
        points = sorted((int(i), float(v)) for i, v in history if v is not None and math.isfinite(float(v)))
        steps = sorted((int(i), float(v)) for i, v in (champions or []) if v is not None and math.isfinite(float(v)))
        if not points and not steps:
            return None
        if not steps:
            run_min = math.inf
            for i, y in points:
                if y < run_min:
                    run_min = y
                    steps.append((i, y))
        import matplotlib

        matplotlib.use("Agg", force=False)
        from matplotlib.figure import Figure  # no pyplot: no global figure state, thread-safe

        last = max([i for i, _ in points + steps])
        sx = [i for i, _ in steps] + [last]
        sy = [y for _, y in steps] + [steps[-1][1]]
        ys = [y for _, y in points] + sy
        fig = Figure(figsize=(7, 4), dpi=100)
        ax = fig.add_subplot(1, 1, 1)
        if points:
            ax.scatter([i for i, _ in points], [y for _, y in points], s=12, alpha=0.5, label=f"{len(points)} correct")
        ax.step(sx, sy, where="post", color="C1", label="champion")
        ax.scatter([i for i, _ in steps], [y for _, y in steps], marker="*", s=60, color="C1", zorder=3)
        ax.set_xlabel("candidate index")
        ax.set_ylabel("latency (ms)")
        ax.set_title(f"{self.task} on {self.gpu}: champion {sy[-1]:.4g} ms")
        if max(ys) / max(min(ys), 1e-12) > 50:
            ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        with tempfile.TemporaryDirectory(prefix="kernelarc-plot-") as tmp:
            path = Path(tmp) / name
            fig.savefig(path, format="png")
            with self._lock:
                self.client.log_artifact(parent, str(path))
        return name

    def end_session(self, status: str = "FINISHED", summary: Mapping[str, Any] | None = None) -> None:
        """Close the parent run. Numeric summary entries become metrics, the rest tags; all of it
        is also written as ``summary.json``."""
        if status not in ("FINISHED", "FAILED", "KILLED"):
            raise ValueError(f"status must be FINISHED, FAILED or KILLED, got {status!r}")
        parent = self._require_session()
        summary = redact(dict(summary or {}))
        numeric = {
            k: v
            for k, v in summary.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v is not None
        }
        other = {f"kernelarc.summary.{k}": v for k, v in summary.items() if k not in numeric and v is not None}
        with self._lock:
            # At the series' last step: a summary at step 0 would make ``evaluated`` fall back in the charts.
            self._log_batch(parent, metrics=self._metrics(numeric, step=self._last_step), tags=self._tags(other))
            if summary:
                with tempfile.TemporaryDirectory(prefix="kernelarc-sum-") as tmp:
                    path = Path(tmp) / "summary.json"
                    path.write_text(scrub_text(json.dumps(summary, indent=2, sort_keys=True, default=str)))
                    self.client.log_artifact(parent, str(path))
            self.client.set_terminated(parent, status)
        self.parent_run_id = None
        checkpoint_sqlite(self.uri)

    # -- queries -------------------------------------------------------------

    def find_candidate_runs(self, parent_run_id: str | None = None) -> dict[str, str]:
        """candidate id -> child run id under a session (the latest run wins for duplicates)."""
        parent = parent_run_id or self._require_session()
        found: dict[str, tuple[int, str]] = {}
        token = None
        while True:
            page = self.client.search_runs(
                [self.experiment_id],
                filter_string=f"tags.`{PARENT_TAG}` = '{parent}'",
                max_results=1000,
                page_token=token,
            )
            for run in page:
                cid = run.data.tags.get("kernelarc.candidate_id")
                if cid and (cid not in found or run.info.start_time >= found[cid][0]):
                    found[cid] = (run.info.start_time, run.info.run_id)
            token = page.token
            if not token:
                break
        return {cid: rid for cid, (_, rid) in found.items()}

    def artifact_uri(self, run_id: str) -> str:
        return self.client.get_run(run_id).info.artifact_uri

    # -- context manager: a crash marks the session FAILED --------------------

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self.parent_run_id is not None:
            self.end_session("FAILED" if exc_type else "FINISHED")
