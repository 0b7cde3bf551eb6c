"""A small surrogate model of a family's speed over its knob space, and point repair.

The offline agents use it to choose among several local moves: each move is scored by a
ridge regression of log(speed relative to the champion) fitted on what the board and the
agent's own attempts say about the same family, plus an exploration bonus for points far
from anything measured. It is a ranking aid, never a result: every proposal is still
checked and timed by the guard.

``repair`` handles coupled knobs: a move of one knob (a wider tile) can make the point
infeasible unless another knob follows (more warps, fewer pipeline stages). Instead of
discarding the move, the nearest feasible point that keeps the moved knobs is taken.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from kernelarc.families import Family


def _numeric(values: tuple[Any, ...]) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def features(fam: Family, point: Mapping[str, Any]) -> list[float]:
    """Ordinal knobs -> position in [0, 1] and its square; categorical knobs -> one-hot."""
    out: list[float] = []
    for knob in fam.knobs:
        vals = knob.values
        v = point.get(knob.name, fam.start.get(knob.name))
        idx = vals.index(v) if v in vals else 0
        if _numeric(vals) and len(vals) > 2:
            x = idx / (len(vals) - 1)
            out += [x, x * x]
        else:
            out += [1.0 if i == idx else 0.0 for i in range(1, len(vals))]
    return out


class Surrogate:
    """Ridge regression of log-speed on knob features, for one family."""

    def __init__(self, fam: Family, observations: Iterable[tuple[Mapping[str, Any], float]], ridge: float = 0.3):
        self.fam = fam
        xs, ys = [], []
        for point, speed in observations:
            if speed and speed > 0 and math.isfinite(speed):
                xs.append(features(fam, point))
                ys.append(math.log(speed))
        self.n = len(xs)
        self._x = np.asarray(xs, dtype=float) if xs else np.zeros((0, 0))
        self._w: np.ndarray | None = None
        if self.n >= 4:
            x = np.hstack([np.ones((self.n, 1)), self._x])
            reg = ridge * np.eye(x.shape[1])
            reg[0, 0] = 0.0  # do not shrink the intercept
            self._w = np.linalg.solve(x.T @ x + reg, x.T @ np.asarray(ys))

    @property
    def ready(self) -> bool:
        return self._w is not None

    def score(self, point: Mapping[str, Any], explore: float = 0.05) -> float:
        """Predicted log-speed plus a bonus growing with the distance to the nearest measured point."""
        f = np.asarray(features(self.fam, point), dtype=float)
        pred = float(self._w[0] + f @ self._w[1:]) if self._w is not None else 0.0
        if self.n:
            dist = float(np.min(np.sqrt(((self._x - f) ** 2).sum(axis=1))))
            pred += explore * dist
        return pred


def repair(
    fam: Family, point: Mapping[str, Any], fixed: Iterable[str], rng: random.Random, max_steps: int = 3
) -> dict[str, Any] | None:
    """The feasible point nearest to ``point`` (in knob index steps) that keeps the ``fixed`` knobs.

    Returns ``point`` itself when it is feasible, None when nothing within ``max_steps`` is.
    """
    point = dict(point)
    if fam.valid(point):
        return point
    free = [k for k in fam.knobs if k.name not in set(fixed)]
    for steps in range(1, max_steps + 1):
        options = []
        combos = itertools.chain.from_iterable(
            itertools.combinations(free, size) for size in range(1, min(steps, len(free)) + 1)
        )
        for combo in combos:
            # every way to move each knob of the combo by a nonzero offset whose sizes sum to `steps`
            for offsets in itertools.product(*[range(-steps, steps + 1)] * len(combo)):
                if 0 in offsets or sum(abs(o) for o in offsets) != steps:
                    continue
                cand = dict(point)
                ok = True
                for knob, off in zip(combo, offsets, strict=True):
                    cur = point.get(knob.name)
                    idx = knob.values.index(cur) if cur in knob.values else 0
                    j = idx + off
                    if not 0 <= j < len(knob.values):
                        ok = False
                        break
                    cand[knob.name] = knob.values[j]
                if ok and fam.valid(cand):
                    options.append(cand)
        if options:
            return options[rng.randrange(len(options))]
    return None
