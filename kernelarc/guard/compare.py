"""Numerical comparison of a candidate's outputs with the judge's references."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

# ||out - ref64|| / ||ref64|| allowed per output dtype (METHOD.md's ranges), unless the
# reference itself is further from the float64 reference than this.
REL_ERR_BOUND = {
    torch.float64: 1e-10,
    torch.float32: 1e-3,
    torch.float16: 5e-3,
    torch.bfloat16: 2e-2,
    torch.float8_e4m3fn: 1.5e-1,
    torch.float8_e5m2: 2.5e-1,
}


@dataclass
class Comparison:
    ok: bool
    message: str = ""
    max_abs_err: float | None = None
    matched_ratio: float | None = None
    rel_err: float | None = None


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    denom = torch.linalg.vector_norm(b64).item()
    num = torch.linalg.vector_norm(a64 - b64).item()
    return num / denom if denom > 0 else num


def compare_output(
    name: str,
    out: Any,
    ref: Any,
    ref_hp: Any | None,
    atol: float,
    rtol: float,
    ratio: float,
) -> Comparison:
    if not isinstance(ref, torch.Tensor):
        # Python scalar outputs.
        if isinstance(out, torch.Tensor):
            return Comparison(False, f"{name}: expected a scalar")
        ok = abs(float(out) - float(ref)) <= atol + rtol * abs(float(ref))
        return Comparison(ok, "" if ok else f"{name}: {out} != {ref}")
    if tuple(out.shape) != tuple(ref.shape):
        return Comparison(False, f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}")
    if out.numel() == 0:
        return Comparison(True, matched_ratio=1.0, max_abs_err=0.0)
    if not out.dtype.is_floating_point:
        eq = out == ref
        r = eq.float().mean().item()
        ok = r >= ratio
        msg = "" if ok else f"{name}: {r:.4%} of elements equal, required {ratio:.4%}; first mismatch at {_first(~eq)}"
        return Comparison(ok, msg, matched_ratio=r)
    o = out.to(torch.float32)
    r_ = ref.to(torch.float32)
    o_fin, r_fin = torch.isfinite(o), torch.isfinite(r_)
    bad = ~o_fin & r_fin
    if bad.any():
        return Comparison(
            False, f"{name}: {int(bad.sum())} NaN/Inf values where the reference is finite, first at {_first(bad)}"
        )
    same_nonfinite = ~o_fin & ~r_fin & ((o == r_) | (torch.isnan(o) & torch.isnan(r_)))
    if bool((o == 0).all()) and not bool((r_ == 0).all()):
        return Comparison(False, f"{name}: output is all zeros")
    both = o_fin & r_fin
    diff = torch.where(both, (o - r_).abs(), torch.zeros_like(o))
    within = (diff <= atol + rtol * r_.abs()) & both | same_nonfinite
    matched = within.float().mean().item()
    max_abs = diff.max().item()
    rel = None
    if ref_hp is not None and isinstance(ref_hp, torch.Tensor) and ref_hp.shape == out.shape:
        hp = ref_hp.to(torch.float64)
        if bool(torch.isfinite(hp).all()) and bool(o_fin.all()):
            rel = _rel(o, hp)
            ref_err = _rel(r_, hp)
            bound = max(REL_ERR_BOUND.get(out.dtype, 2e-2), 4 * ref_err)
            if rel > bound:
                return Comparison(
                    False,
                    f"{name}: relative error {rel:.3e} vs the float64 reference exceeds {bound:.3e} "
                    f"(the reference itself: {ref_err:.3e})",
                    max_abs,
                    matched,
                    rel,
                )
    if matched < ratio:
        idx = _first(~within)
        return Comparison(
            False,
            f"{name}: {matched:.4%} of elements within atol={atol:g} rtol={rtol:g}, required {ratio:.4%}; "
            f"max abs err {max_abs:.4g}; first mismatch at {idx}: got {o[idx].item():.5g}, expected {r_[idx].item():.5g}",
            max_abs,
            matched,
            rel,
        )
    return Comparison(True, "", max_abs, matched, rel)


def _first(mask: torch.Tensor) -> tuple[int, ...]:
    nz = mask.nonzero()
    return tuple(int(i) for i in nz[0].tolist()) if len(nz) else ()
