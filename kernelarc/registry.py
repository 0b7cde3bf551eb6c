"""The champion store: the MLflow model registry.

Registered model ``kernelarc.<task>.<gpu>``; every promoted kernel is a version whose source
is the child run's ``kernel/`` artifact folder (``kernel.py``, ``candidate.json``,
``verdict.json``). The alias ``champion`` marks the current best. That folder is an MLflow
model too (``MLmodel``, ``code/kernelarc_pyfunc.py``, ``definition.json``, ``input_example.pt``):
``mlflow.pyfunc.load_model("models:/kernelarc.<task>.<gpu>@champion").predict([x, w])`` runs
the kernel on the inputs in definition order and returns its outputs (``kernelarc.pyfunc_model``).
A kernel registered again (the reference baseline of every session) keeps its first version.

The promotion RULE (the alias moves only to a version that beat the current champion, both
measured side by side in the same run on the same GPU) is decided by the caller, which holds
the interleaved measurement; ``promote`` enforces the part it can see.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import math
import platform
import re
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from kernelarc import pyfunc_model
from kernelarc.models import Candidate, Verdict
from kernelarc.tracking import (
    CANDIDATE_ARTIFACT_DIR,
    MAX_KEY,
    Tracker,
    default_tracking_uri,
    prepare_sqlite,
    scrub_text,
    store_init_lock,
    tune_store,
)

log = logging.getLogger(__name__)

CHAMPION = "champion"
PYFUNC_LOADER = "kernelarc_pyfunc"  # pyfunc_model.py's name inside a model's code/ folder
INPUT_EXAMPLE = "input_example.pt"
MAX_EXAMPLE_BYTES = 8 << 20  # the smallest workload's inputs ride along up to this size
# Definition dtypes numpy can hold (a tensor signature); bfloat16 and fp8 have none: their shapes and
# dtypes are in the model's metadata and definition.json only.
_NUMPY_DTYPES = ("float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
_MODEL_URI_RE = re.compile(r"^models:/(?P<name>[^/@]+)(?:@(?P<alias>[\w\-]+)|/(?P<version>\d+))$")
_VERSION_METRICS = (
    "latency_ms",
    "speedup_vs_baseline",
    "speedup_vs_compile",
    "speedup_vs_champion",
    "sol_fraction",
    "sol_score",
    "tflops",
    "tbps",
    "noise",
)


def model_name(task: str, gpu: str) -> str:
    """``kernelarc.<task>.<gpu>``; '/' and ':' are not allowed in registered model names."""
    clean = [re.sub(r"[/:\s]+", "_", str(part)).strip("_") for part in (task, gpu)]
    if not all(clean):
        raise ValueError(f"task and gpu must be non-empty, got {task!r}, {gpu!r}")
    return f"kernelarc.{clean[0]}.{clean[1]}"


def collect_versions_info(gpu_name: str | None = None, **extra: Any) -> dict[str, str]:
    """Software versions for a version's tags, read from package metadata (imports nothing,
    touches no GPU). Pass the device name measured by the worker as ``gpu_name``."""
    info = {"python": platform.python_version(), "platform": platform.platform(terse=True)}
    for key, dists in (
        ("torch", ("torch",)),
        ("triton", ("triton",)),
        ("mlflow", ("mlflow", "mlflow-skinny")),
        ("nvidia-cutlass", ("nvidia-cutlass",)),
    ):
        for dist in dists:
            with contextlib.suppress(importlib.metadata.PackageNotFoundError):
                info[key] = importlib.metadata.version(dist)
                break
    if gpu_name:
        info["gpu_name"] = gpu_name
    info.update({k: str(v) for k, v in extra.items() if v is not None})
    return info


def _tag_value(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


class Registry:
    """Champion store for one (task, gpu)."""

    def __init__(self, tracker_or_client: Tracker | Any | str | None, task: str, gpu: str, problem: Any = None):
        """``problem``: the loaded ``kernelarc.tasks.loader.Task``; with it, a version's model carries the
        task definition (input names and order for ``predict``, signature, an input example)."""
        from mlflow import MlflowClient

        if isinstance(tracker_or_client, Tracker):
            self.client = tracker_or_client.client
        elif tracker_or_client is None or isinstance(tracker_or_client, str):
            uri = tracker_or_client or default_tracking_uri()
            prepare_sqlite(uri)
            with store_init_lock(uri):
                self.client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        elif isinstance(tracker_or_client, MlflowClient):
            self.client = tracker_or_client
        else:
            raise TypeError(f"expected a Tracker, an MlflowClient or a tracking URI, got {type(tracker_or_client)}")
        self.task = task
        self.gpu = gpu
        self.problem = problem
        self.name = model_name(task, gpu)
        self._lock = threading.Lock()
        uri = self.client._tracking_client.tracking_uri
        with store_init_lock(uri), contextlib.suppress(Exception):  # private API moved: logging is only slower
            tune_store(self.client._get_registry_client().store)

    # -- writing -------------------------------------------------------------

    def _ensure_model(self) -> None:
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(self.name)
        except MlflowException as exc:
            if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            try:
                self.client.create_registered_model(
                    self.name,
                    tags={"kernelarc.task": self.task, "kernelarc.gpu": self.gpu},
                    description=f"KernelArc champions for task {self.task} on {self.gpu}.",
                )
            except MlflowException as exc2:  # created concurrently by another session
                if exc2.error_code != "RESOURCE_ALREADY_EXISTS":
                    raise

    def register(
        self, candidate: Candidate, verdict: Verdict, run_id: str, versions_info: dict[str, Any] | None = None
    ) -> int:
        """A new version from the child run's ``kernel/`` artifacts; returns its number.

        Tags: the verdict's metrics, candidate id, language, agent, strategy, family, knobs,
        gpu and every entry of ``versions_info`` (see ``collect_versions_info``).
        """
        if not run_id:
            raise ValueError("run_id is required: register the child run logged by Tracker.log_candidate")
        if verdict.candidate_id != candidate.id:
            raise ValueError(f"verdict is for candidate {verdict.candidate_id}, not {candidate.id}")
        if not verdict.correct:
            raise ValueError(f"refusing to register candidate {candidate.id}: verdict is {verdict.status.value}")
        existing = self.version_for(candidate.id)
        if existing is not None:  # the same kernel (e.g. the reference baseline of a later session)
            self._ensure_pyfunc(existing)
            log.info("%s: candidate %s is version %s already", self.name, candidate.id, existing)
            return existing
        run = self.client.get_run(run_id)
        source = run.info.artifact_uri.rstrip("/") + "/" + CANDIDATE_ARTIFACT_DIR
        self._write_model(candidate, verdict, run_id)

        tags: dict[str, Any] = {
            "candidate_id": candidate.id,
            "language": candidate.language,
            "agent": candidate.agent,
            "strategy": candidate.strategy,
            "family": candidate.family,
            "parent": candidate.parent,
            "knobs": candidate.knobs or None,
            "verdict": verdict.status.value,
            "gpu": self.gpu,
            "task": self.task,
        }
        for name in _VERSION_METRICS:
            tags[name] = getattr(verdict, name)
        for key, value in (versions_info or {}).items():
            tags.setdefault(str(key), value)
        clean = {
            re.sub(r"[^\w.\- /]", "_", k)[:MAX_KEY]: scrub_text(_tag_value(v)) for k, v in tags.items() if v is not None
        }
        with self._lock:
            self._ensure_model()
            mv = self.client.create_model_version(
                self.name,
                source=source,
                run_id=run_id,
                tags=clean,
                description=scrub_text(candidate.rationale)[:5000] or None,
            )
        log.info("registered %s version %s (candidate %s)", self.name, mv.version, candidate.id)
        return int(mv.version)

    # -- the MLflow model of a version ----------------------------------------

    def _write_model(self, candidate: Candidate, verdict: Verdict, run_id: str) -> None:
        """Make the run's ``kernel/`` folder an MLflow pyfunc model (files added beside the kernel)."""
        from mlflow.models import Model

        definition = self._definition()
        metadata: dict[str, Any] = {
            "model": self.name,
            "task": self.task,
            "gpu": self.gpu,
            "candidate_id": candidate.id,
            "language": candidate.language,
            "family": candidate.family,
            "entry_point": "kernel.py::run",
            "predict": "model.predict([inputs in definition order]) -> the kernel's outputs (torch tensors)",
        }
        for name in _VERSION_METRICS:
            value = getattr(verdict, name)
            if value is not None and math.isfinite(value):
                metadata[name] = value
        with tempfile.TemporaryDirectory(prefix="kernelarc-model-") as tmp:
            mdir = Path(tmp) / CANDIDATE_ARTIFACT_DIR
            (mdir / "code").mkdir(parents=True)
            shutil.copyfile(pyfunc_model.__file__, mdir / "code" / f"{PYFUNC_LOADER}.py")
            signature = None
            if definition is not None:
                (mdir / pyfunc_model.DEFINITION_FILE).write_text(json.dumps(definition, indent=2))
                metadata["inputs"] = _specs(definition.get("inputs", {}))
                metadata["outputs"] = _specs(definition.get("outputs", {}))
                signature = _signature(definition)
                example = self._input_example(mdir / INPUT_EXAMPLE)
                if example is not None:
                    metadata["input_example"] = {"file": INPUT_EXAMPLE, "axes": example}
            (mdir / "requirements.txt").write_text("\n".join(_requirements(candidate)) + "\n")
            model = Model(artifact_path=CANDIDATE_ARTIFACT_DIR, run_id=run_id, signature=signature, metadata=metadata)
            model.add_flavor(
                "python_function",
                loader_module=PYFUNC_LOADER,
                code="code",
                data="kernel.py",
                python_version=platform.python_version(),
            )
            model.add_flavor("kernelarc", language=candidate.language, source="kernel.py", task=self.task)
            model.save(str(mdir / "MLmodel"))
            self.client.log_artifacts(run_id, str(mdir), CANDIDATE_ARTIFACT_DIR)

    def _ensure_pyfunc(self, version: int) -> None:
        """A version registered before versions were MLflow models gets its model files now."""
        mv = self._model_version(version)
        if mv is None or not mv.run_id:
            return
        names = {a.path.rsplit("/", 1)[-1] for a in self.client.list_artifacts(mv.run_id, CANDIDATE_ARTIFACT_DIR)}
        if "MLmodel" in names:
            return
        try:
            cand = self._load(mv)
            verdict_path = self.client.download_artifacts(mv.run_id, f"{CANDIDATE_ARTIFACT_DIR}/verdict.json")
            verdict = Verdict.model_validate_json(Path(verdict_path).read_text())
            self._write_model(cand, verdict, mv.run_id)
        except Exception as exc:  # noqa: BLE001 - the kernel itself stays registered and exportable
            log.warning("%s v%s: could not add its MLflow model files: %s", self.name, version, exc)

    def _definition(self) -> dict[str, Any] | None:
        if self.problem is None:
            return None
        path = Path(getattr(self.problem, "path", "")) / "definition.json"
        if path.is_file():
            return json.loads(path.read_text())
        return self.problem.definition.model_dump(mode="json")

    def _input_example(self, path: Path) -> dict[str, int] | None:
        """The smallest workload's inputs (seed 0, CPU tensors) as ``torch.save`` of a list; its axes."""
        import torch

        from kernelarc.tasks.inputs import make_inputs

        try:
            index = min(range(len(self.problem.workloads)), key=self.problem.io_bytes)
            if self.problem.io_bytes(index) > MAX_EXAMPLE_BYTES:
                return None
            torch.save(make_inputs(self.problem, index, 0, "cpu"), path)
            return self.problem.axes(index)
        except Exception as exc:  # noqa: BLE001 - custom inputs may need a GPU: the model works without
            log.debug("%s: no input example: %s", self.name, exc)
            return None

    def set_champion(self, version: int) -> None:
        """Point the ``champion`` alias at ``version`` (no checks: see ``promote``)."""
        with self._lock:
            self.client.set_registered_model_alias(self.name, CHAMPION, str(int(version)))
            self.client.set_model_version_tag(
                self.name, str(int(version)), "kernelarc.promoted_at", time.strftime("%Y-%m-%dT%H:%M:%S%z")
            )

    def promote(self, version: int, beat_champion: bool) -> bool:
        """Move ``champion`` to ``version`` unless a champion exists and was not beaten.

        ``beat_champion`` must come from the side-by-side, same-run, same-GPU comparison.
        The first version ever promoted has nothing to beat. Returns whether the alias moved
        (or already pointed at ``version``).
        """
        current = self.champion_version()
        if current is not None and current == int(version):
            return True
        if current is not None and not beat_champion:
            log.info("not promoting %s v%s: it did not beat champion v%s", self.name, version, current)
            return False
        self.set_champion(version)
        return True

    # -- reading -------------------------------------------------------------

    def champion_version(self) -> int | None:
        mv = self._model_version(CHAMPION)
        return None if mv is None else int(mv.version)

    def champion(self) -> tuple[int, Candidate, dict[str, str]] | None:
        """``(version, Candidate, version tags)`` of ``models:/<name>@champion``, or None."""
        mv = self._model_version(CHAMPION)
        if mv is None:
            return None
        return int(mv.version), self._load(mv), dict(mv.tags)

    def versions(self) -> list[int]:
        return sorted(int(mv.version) for mv in self.client.search_model_versions(f"name = '{self.name}'"))

    def version_for(self, candidate_id: str) -> int | None:
        """The newest version registered for a candidate (avoids double registration on resume)."""
        found = [
            int(mv.version)
            for mv in self.client.search_model_versions(f"name = '{self.name}'")
            if mv.tags.get("candidate_id") == candidate_id
        ]
        return max(found) if found else None

    def version_tags(self, version_or_alias: int | str) -> dict[str, str]:
        mv = self._model_version(version_or_alias)
        if mv is None:
            raise LookupError(f"{self.name}: no version {version_or_alias!r}")
        return dict(mv.tags)

    def load_kernel(self, version_or_alias: int | str) -> Candidate:
        """Rebuild the Candidate of a version: a number, an alias (``"champion"``) or a
        ``models:/<name>@<alias>`` / ``models:/<name>/<version>`` URI."""
        mv = self._model_version(version_or_alias)
        if mv is None:
            raise LookupError(f"{self.name}: no version {version_or_alias!r}")
        return self._load(mv)

    def materialize(self, version_or_alias: int | str, dst_dir: str | Path) -> Path:
        """Download a version's ``kernel/`` folder to ``dst_dir``; returns the ``kernel.py`` path
        (what a guard worker imports)."""
        mv = self._model_version(version_or_alias)
        if mv is None:
            raise LookupError(f"{self.name}: no version {version_or_alias!r}")
        return self._download(mv, Path(dst_dir)) / "kernel.py"

    # -- internals -----------------------------------------------------------

    def _model_version(self, version_or_alias: int | str):
        """ModelVersion for a number, alias or models:/ URI; None when it does not exist."""
        from mlflow.exceptions import MlflowException

        name = self.name
        ref: int | str = version_or_alias
        if isinstance(ref, str):
            m = _MODEL_URI_RE.match(ref.strip())
            if m:
                name = m["name"]
                ref = m["alias"] if m["alias"] else int(m["version"])
            elif ref.strip().isdigit():
                ref = int(ref.strip())
            elif ref.startswith("models:/"):
                raise ValueError(
                    f"cannot parse model URI {ref!r}: expected models:/<name>@<alias> or models:/<name>/<v>"
                )
        if isinstance(ref, bool) or not isinstance(ref, (int, str)):
            raise TypeError(f"expected a version number, an alias or a models:/ URI, got {version_or_alias!r}")
        try:
            if isinstance(ref, int):
                return self.client.get_model_version(name, str(ref))
            return self.client.get_model_version_by_alias(name, ref)
        except MlflowException as exc:
            if exc.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE", "NOT_FOUND"):
                return None
            raise

    def _download(self, mv, dst: Path) -> Path:
        dst.mkdir(parents=True, exist_ok=True)
        if mv.run_id:
            local = self.client.download_artifacts(mv.run_id, CANDIDATE_ARTIFACT_DIR, str(dst))
        else:  # a version created from a bare URI
            import mlflow.artifacts

            local = mlflow.artifacts.download_artifacts(
                artifact_uri=mv.source, dst_path=str(dst), tracking_uri=self.client._tracking_client.tracking_uri
            )
        return Path(local)

    def _load(self, mv) -> Candidate:
        with tempfile.TemporaryDirectory(prefix="kernelarc-reg-") as tmp:
            kdir = self._download(mv, Path(tmp))
            source = (kdir / "kernel.py").read_text()
            meta = json.loads((kdir / "candidate.json").read_text())
        expected = meta.pop("id", None)
        fields = {k: v for k, v in meta.items() if k in Candidate.model_fields and k != "source"}
        candidate = Candidate(source=source, **fields)
        if expected and candidate.id != expected:
            log.warning("%s v%s: candidate id %s != recorded %s", self.name, mv.version, candidate.id, expected)
        return candidate


def kernel_library(uri: str | None, gpu: str, families: dict[str, set[str]]) -> dict[str, tuple[dict[str, Any], str]]:
    """The registry as a kernel library: for each built-in task of ``families`` (task -> the kernel families
    a problem can use for it), the knobs of ``models:/kernelarc.<task>.<gpu>@champion`` where that champion
    is one of those families; ``{family: (knobs, "kernelarc.<task>.<gpu> v<version>")}``. Read from the
    version tags (nothing is downloaded). A store that cannot be read gives an empty library and a warning:
    the search then starts from the families' own start points."""
    out: dict[str, tuple[dict[str, Any], str]] = {}
    if not families:
        return out
    uri = uri or default_tracking_uri()
    try:
        client = None
        for task, names in sorted(families.items()):
            reg = Registry(client or uri, task, gpu)  # the first opens the store; the others share its client
            client, name = reg.client, reg.name
            mv = reg._model_version(CHAMPION)
            if mv is None:
                continue  # no champion registered for that task on this GPU
            fam = mv.tags.get("family")
            if fam not in names:
                continue  # a baseline, a dispatch or another task's family: nothing to start a site from
            try:
                knobs = json.loads(mv.tags.get("knobs") or "{}")
            except ValueError:
                continue
            if isinstance(knobs, dict) and knobs:
                out[fam] = (knobs, f"{name} v{mv.version}")
    except Exception as e:  # noqa: BLE001 - a library that cannot be read costs the start points, not the session
        log.warning("kernel library: the registry at %s could not be read (%s); using the families' start points",
                    uri, str(e).splitlines()[0][:200])  # fmt: skip
        return {}
    return out


def _specs(tensors: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": n, "dtype": t.get("dtype"), "shape": t.get("shape")} for n, t in tensors.items()]


def _signature(definition: dict[str, Any]):
    """A tensor signature (symbolic axes as -1) when numpy holds every dtype, else None.

    The signature is marked as coming from type hints: MLflow then passes the inputs through
    unchanged (its schema enforcement takes numpy arrays only; the kernel takes torch tensors)."""
    import numpy as np
    from mlflow.models.signature import ModelSignature
    from mlflow.types.schema import Schema, TensorSpec

    def schema(tensors: dict[str, Any]) -> Schema | None:
        specs = []
        for name, t in tensors.items():
            if t.get("dtype") not in _NUMPY_DTYPES:
                return None
            shape = tuple(d if isinstance(d, int) else -1 for d in (t.get("shape") or ()))
            specs.append(TensorSpec(np.dtype(t["dtype"]), shape, name))
        return Schema(specs) if specs else None

    inputs, outputs = schema(definition.get("inputs", {})), schema(definition.get("outputs", {}))
    if inputs is None or outputs is None:
        return None
    sig = ModelSignature(inputs=inputs, outputs=outputs)
    sig._is_signature_from_type_hint = True
    return sig


def _requirements(candidate: Candidate) -> list[str]:
    reqs = []
    for dist in ("torch", "triton", "nvidia-cutlass"):
        if dist == "triton" and "triton" not in candidate.source:
            continue
        if dist == "nvidia-cutlass" and candidate.language != "cutlass":
            continue
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            reqs.append(f"{dist}=={importlib.metadata.version(dist).split('+')[0]}")
    return reqs
