"""The promotion rule: a pure function of measurements.

Given the challenger's and the champion's latency samples, measured interleaved in the
same worker, the challenger is promoted only if it is faster by more than the measured
noise. The same samples always give the same decision.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


def median(xs: list[float]) -> float:
    ys = sorted(xs)
    n = len(ys)
    if n == 0:
        return math.nan
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])


def quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    if not ys:
        return math.nan
    pos = q * (len(ys) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(ys) - 1)
    return ys[lo] + (ys[hi] - ys[lo]) * (pos - lo)


def rel_noise(xs: list[float]) -> float:
    """Relative spread of timing samples: interquartile range over the median; with fewer than five samples
    (a slow call timed twice per side) the whole range, since quartiles of two or three points understate it."""
    m = median(xs)
    if not xs or not m or math.isnan(m):
        return math.inf
    if len(xs) < 5:
        return (max(xs) - min(xs)) / m
    return (quantile(xs, 0.75) - quantile(xs, 0.25)) / m


def geomean(xs: list[float]) -> float:
    xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def workload_noise(challenger: list[float], champion: list[float]) -> float:
    """One workload's relative noise in a comparison: the larger of the two sides'."""
    return max(rel_noise(challenger), rel_noise(champion))


def slowed_champion(champion: list[float], crowned_ms: float | None, consistency: float) -> float | None:
    """The champion's median beside a challenger where it is more than ``consistency`` times its crowned latency
    (the comparison is void); None where it is not, or no crowned latency is known."""
    if not crowned_ms or crowned_ms <= 0 or not champion:
        return None
    now = median(champion)
    return now if now / crowned_ms > consistency else None


def noise_bar(noise: float, min_gain: float, noise_factor: float = 1.0) -> float:
    """The speedup a challenger must exceed over a comparison whose relative noise is ``noise``."""
    return 1.0 + max(min_gain, noise_factor * noise)


@dataclass(frozen=True)
class Decision:
    promote: bool
    speedup: float  # geometric mean over workloads of champion median / challenger median
    required: float  # the speedup that was needed
    reason: str


def decide(
    challenger: dict[int, list[float]],
    champion: dict[int, list[float]] | None,
    *,
    min_gain: float = 0.01,
    noise_factor: float = 1.0,
    champion_reference: dict[int, float] | None = None,
    consistency: float = 1.5,
) -> Decision:
    """Promote iff the challenger is faster than the champion by more than the noise: over all
    workloads (the geomean), or on some workloads while no slower on any (a Pareto gain).

    ``challenger`` and ``champion`` map workload index to latency samples (ms) measured
    interleaved. ``champion_reference`` (workload -> the champion's own median when it was
    crowned) voids comparisons where the champion ran more than ``consistency`` times slower
    than that: what a challenger that steals the champion's GPU or CPU would show. A champion that
    ran faster than when crowned only raises the bar a challenger must clear, and is no cause to
    void (on the H200, with seven sessions sharing the machine, composed candidates 2.5-3x faster
    than a champion's crowning latency were judged correct_slower, most likely so: that run kept no
    warnings to confirm it). The required speedup is ``1 + max(min_gain, noise_factor * noise)``. Each
    workload's noise is the larger relative IQR of the two sides; the geomean's noise combines
    them as independent errors of a mean of logs, sqrt(sum of squares) / number of workloads, so
    one noisy workload out of four does not set the bar alone (with one workload it is that
    workload's noise).

    The Pareto route: with several workloads, a challenger that beats one workload's own bar
    (``1 + max(min_gain, noise_factor * that workload's noise)``) and is nowhere slower than the
    inverse of that workload's bar is promoted too, though its geomean gain may sit inside the
    combined noise. That is a shape dispatch's typical result: a 5% gain on one shape of four, the
    same kernel (a tie) on the rest, is a 1.2% geomean that the noise of the other shapes would
    otherwise hide for good.
    """
    if not challenger:
        return Decision(False, math.nan, math.nan, "no timing samples")
    if champion is None:
        return Decision(True, math.nan, 1.0, "first correct candidate")
    common = sorted(set(challenger) & set(champion))
    if not common:
        return Decision(False, math.nan, math.nan, "no workload timed for both")
    if champion_reference:
        # The champion timed side by side must not be much slower than the champion timed alone; if it
        # is, something in the challenger's process may have slowed it and the comparison is void.
        for w in common:
            ref = champion_reference.get(w)
            if (now := slowed_champion(champion[w], ref, consistency)) is not None:
                return Decision(
                    False, math.nan, math.nan,
                    f"champion measured {now:.4g} ms side by side vs {ref:.4g} ms alone on "
                    f"workload {w}: inconsistent comparison, not promoted",
                )  # fmt: skip
    ratios = [median(champion[w]) / median(challenger[w]) for w in common]
    speedup = geomean(ratios)
    per_wl = [workload_noise(challenger[w], champion[w]) for w in common]
    noise = math.sqrt(sum(x * x for x in per_wl)) / len(per_wl)
    required = noise_bar(noise, min_gain, noise_factor)
    if speedup > required:
        return Decision(True, speedup, required, f"{speedup:.3f}x faster > required {required:.3f}x")
    if len(common) > 1 and speedup > 1.0:
        bars = [noise_bar(x, min_gain, noise_factor) for x in per_wl]
        faster = [(w, r, b) for w, r, b in zip(common, ratios, bars, strict=True) if r > b]
        slower = [w for w, r, b in zip(common, ratios, bars, strict=True) if r < 1.0 / b]
        if faster and not slower:
            wins = ", ".join(f"workload {w} {r:.3f}x > {b:.3f}x" for w, r, b in faster)
            return Decision(
                True, speedup, required,
                f"Pareto gain: {wins}; no workload slower beyond its noise ({speedup:.3f}x geomean)",
            )  # fmt: skip
    return Decision(False, speedup, required, f"{speedup:.3f}x is within the required {required:.3f}x")
