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
