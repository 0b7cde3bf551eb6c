"""Test setup: without a GPU, Triton runs through its interpreter (set before triton is imported)."""

import os
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


# The first MLflow access to a new SQLite file creates the schema (~1.7 s or more): build one
# database per pytest session and copy it into each test's working directory.
@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """One schema-initialized SQLite file per pytest session; each test copies it."""
    root = tmp_path_factory.getbasetemp() / "mlflow_template"
    db = root / "mlflow.db"
    if not db.exists():
        root.mkdir(exist_ok=True)
        from mlflow import MlflowClient

        uri = f"sqlite:///{db}"
        from kernelarc.tracking import prepare_sqlite

        prepare_sqlite(uri)
        client = MlflowClient(tracking_uri=uri, registry_uri=uri)
        client.search_experiments()
        client.search_registered_models()
        client._tracking_client.store.engine.dispose()
        client._get_registry_client().store.engine.dispose()
        with sqlite3.connect(db) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return db


@pytest.fixture
def workdir(tmp_path, monkeypatch, mlflow_template) -> Path:
    for suffix in ("", "-wal"):
        src = Path(str(mlflow_template) + suffix)
        if src.exists():
            shutil.copy(src, tmp_path / ("mlflow.db" + suffix))
    monkeypatch.chdir(tmp_path)
    return tmp_path
