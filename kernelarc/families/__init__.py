"""Registry of kernel families, discovered from the modules of this package.

Each module defines a module-level ``FAMILIES: list[Family]``; adding a file adds
its families. ``families_for(task)`` lists the families that solve a built-in task.
"""

from __future__ import annotations

import importlib
import pkgutil
from functools import cache

from kernelarc.families.base import STRATEGIES, Family, Knob

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


def families_for(task: str) -> list[Family]:
    return [f for f in all_families().values() if f.task == task]


def get_family(name: str) -> Family:
    try:
        return all_families()[name]
    except KeyError:
        raise KeyError(f"unknown kernel family {name!r}; known: {sorted(all_families())}") from None
