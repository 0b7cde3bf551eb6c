"""Registry of kernel families, discovered from the modules of this package.

Each module defines a module-level ``FAMILIES: list[Family]``; adding a file adds
its families. ``families_for(task)`` lists the families that solve a task: the built-in
families for a built-in task, and for any other problem the families composed over its
recognised reference graph (``kernelarc.families.composed``).
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache
from typing import TYPE_CHECKING

from kernelarc.families.base import STRATEGIES, Family, Knob

if TYPE_CHECKING:
    from kernelarc.tasks.loader import Task

__all__ = ["STRATEGIES", "Family", "Knob", "all_families", "families_for", "get_family"]


@cache
def all_families() -> dict[str, Family]:
    found: dict[str, Family] = {}
    for mod in pkgutil.iter_modules(__path__):
        if mod.name == "base" or mod.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__name__}.{mod.name}")
        for fam in getattr(module, "FAMILIES", ()):
            if fam.name in found:
                raise ValueError(f"duplicate family name {fam.name!r}")
            found[fam.name] = fam
    return found


def families_for(task: str | Task) -> list[Family]:
    """Families for ``task``: a built-in task name (or a built-in Task) gets its hand-written families;
    any other Task (a SOL-ExecBench problem) gets the families recognised in its reference graph."""
    name = task if isinstance(task, str) else task.name
    builtin = [f for f in all_families().values() if f.task == name]
    if isinstance(task, str) or (builtin and _is_builtin(task)):
        return builtin
    from kernelarc.families.composed import composed_families

    return composed_families(task)


def _is_builtin(task: Task) -> bool:
    from kernelarc.tasks.loader import BUILTIN_DIR

    try:
        return task.path.resolve().parent == BUILTIN_DIR.resolve()
    except OSError:
        return False


def get_family(name: str) -> Family:
    try:
        return all_families()[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(all_families())}") from None
