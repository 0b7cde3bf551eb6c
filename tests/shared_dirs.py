"""Where the guard tests find the shared material (NVIDIA's harness, the SOL-ExecBench problems).

Looked up, in this order: the folder ``$KERNELARC_SHARED`` names; ``shared/`` beside the checkout (a clone
next to it, as here and in CI); ``.shared/`` inside the checkout (an ignored folder, which travels with the
working tree to the GPU machine, where nothing lies beside the checkout).
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def shared_bases() -> list[Path]:
    env = os.environ.get("KERNELARC_SHARED")
    return [*([Path(env)] if env else []), ROOT.parent / "shared", ROOT / ".shared"]


def shared_path(name: str) -> Path:
    """``name`` (e.g. ``sol-execbench-harness``) in the first base that holds it; where none does, the path
    beside the checkout, which does not exist (tests skip on it)."""
    bases = shared_bases()
    return next((b / name for b in bases if (b / name).is_dir()), ROOT.parent / "shared" / name)


SKIP_REASON = "not found in $KERNELARC_SHARED, ../shared or .shared"

HARNESS_SRC = shared_path("sol-execbench-harness") / "src"


def from_harness(module: str, *names: str) -> tuple:
    """``names`` from ``module`` of NVIDIA's vendored harness (``sol_execbench....``; no names: the module),
    imported with its source on ``sys.path`` only while importing; the calling test skips where the harness is
    not found or does not import (its own dependencies missing)."""
    import importlib
    import sys

    import pytest

    path = HARNESS_SRC / (module.replace(".", "/") + ".py")
    if not path.is_file():
        pytest.skip(f"NVIDIA's harness ({path.relative_to(HARNESS_SRC.parent)}): {SKIP_REASON}")
    sys.path.insert(0, str(HARNESS_SRC))
    try:
        mod = importlib.import_module(module)
        return tuple(getattr(mod, n) for n in names) if names else (mod,)
    except ImportError as e:  # pragma: no cover - depends on the environment
        pytest.skip(f"NVIDIA's harness does not import here: {e}")
    finally:
        sys.path.remove(str(HARNESS_SRC))
