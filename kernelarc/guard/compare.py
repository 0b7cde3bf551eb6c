"""Numerical comparison of a candidate's outputs with the judge's references.

The acceptance rule is the one of NVIDIA's SOL-ExecBench harness (``core/bench/correctness.py`` and
``docs/workload.md``), restated here so that an output we call correct is one their evaluator calls correct,
and the other way round (``tests/test_compare.py`` runs both on the same tensors):

- shape and dtype equal to the reference's;
- values compared in float32, integers and booleans too (so an int64 output above 2**24 is compared as
  float32 is, and an integer off by one passes where ``atol + rtol * |ref|`` reaches one);
- any NaN or Inf in the output *or the reference* fails, even where both agree, except positions where
  both are -inf when the workload sets ``allow_negative_inf``;
- an all-zero output fails where the reference is not all zero;
- an element passes when ``|out - ref| <= atol + rtol * |ref|``; the output passes when at least
  ``required_matched_ratio`` of its elements pass (counted in integers) and, when ``max_error_cap`` is set,
  no absolute error exceeds it.

One contract of ours comes on top (issue 15, output layout): a tensor output is on the reference output's
device and is contiguous row-major or laid out as the reference output is, so right values in a
column-major buffer are ``incorrect``. The float64 run of the reference (``ref_hp``) yields the ``rel_err``
metric and one rule more (``_gross_error``): an output grossly off an accurate reference is ``incorrect`` even
where the element-wise rule passes it (values below atol).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

# How many mismatching elements a message lists.
SHOW_MISMATCHES = 3
# Elements compared at once: bounds the float32 temporaries (about 18 bytes an element) for huge outputs.
CHUNK = 1 << 24


@dataclass
class Comparison:
    ok: bool
    message: str = ""
    max_abs_err: float | None = None
    matched_ratio: float | None = None
    rel_err: float | None = None
    matched: int | None = None  # elements within tolerance ...
    total: int | None = None  # ... of this many compared
    ref_rel: float | None = None  # the reference's own relative L2 error against its float64 run, where there was one


def stride_mismatch(strides: list[int] | tuple[int, ...], want: list[int] | tuple[int, ...], shape) -> bool:
    """False when ``strides`` are contiguous row-major or the reference's ``want`` (dimensions of size 1
    ignored): the layout rule of ``layout_error`` on stride lists (the judge gets strides as metadata)."""
    dense, acc = [], 1
    for n in reversed(list(shape)):
        dense.append(acc)
        acc *= max(int(n), 1)
    dense.reverse()

    def same(a, b) -> bool:
        return all(x == y for x, y, n in zip(a, b, shape, strict=True) if n != 1)

    return not (same(strides, dense) or same(strides, want))


def layout_error(name: str, out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why ``out`` breaks the output contract (device, shape, dtype, strides), or None.

    A contiguous row-major output is always right (the harness's own outputs are); any other layout must be
    the reference output's (a reference returning a transposed or split view). A dimension of size 1 may have
    any stride, as PyTorch's own contiguity allows.
    """
    if out.device != ref.device:
        return f"{name}: on {out.device}, expected {ref.device}"
    if tuple(out.shape) != tuple(ref.shape):
        return f"{name}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
    if out.dtype != ref.dtype:
        return f"{name}: dtype {out.dtype}, expected {ref.dtype}"
    if out.numel() <= 1 or out.is_contiguous():
        return None
    want = [s for s, n in zip(ref.stride(), ref.shape, strict=True) if n != 1]
    got = [s for s, n in zip(out.stride(), out.shape, strict=True) if n != 1]
    if want == got:
        return None
    if ref.is_contiguous():
        return (
            f"{name}: strides {tuple(out.stride())} are not contiguous row-major (expected "
            f"{tuple(ref.stride())}, the reference's): the values may be right, the layout is not"
        )
    return (
        f"{name}: strides {tuple(out.stride())} are neither contiguous row-major nor the reference's "
        f"{tuple(ref.stride())}"
    )


def matched_ratio(matched: int, total: int) -> float:
    """The harness's ratio from integer counts: ``1 - exceeding / total``, clamped to [0, 1]."""
    if total <= 0:
        return 1.0
    return max(0.0, min(1.0, 1.0 - (total - matched) / float(total)))


def _num(v: float) -> str:
    return f"{v:.5g}"


def _first_mismatches(
    mask: torch.Tensor,
    o: torch.Tensor,
    r: torch.Tensor,
    k: int = SHOW_MISMATCHES,
    *,
    shape: tuple[int, ...] | None = None,
    offset: int = 0,
) -> str:
    """'at (i, j): got a, expected b; ...' for the first ``k`` True positions of ``mask``. Never raises.

    ``mask``, ``o`` and ``r`` may be a flat chunk starting at element ``offset`` of a tensor of ``shape``.
    """
    try:
        flat = torch.nonzero(mask.reshape(-1))[:k, 0].tolist()
        if not flat:
            return "no single element is beyond tolerance"
        full = tuple(mask.shape) if shape is None else tuple(shape)
        of, rf = o.reshape(-1), r.reshape(-1)
        parts = []
        for f in flat:
            idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(f + offset), full)) if full else ()
            parts.append(f"at {idx}: got {_num(float(of[f]))}, expected {_num(float(rf[f]))}")
        return "first mismatches " + "; ".join(parts)
    except Exception as e:  # noqa: BLE001 - a message must never turn a verdict into a traceback
        return f"(mismatch positions unavailable: {type(e).__name__})"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    denom = torch.linalg.vector_norm(b64).item()
    num = torch.linalg.vector_norm(a64 - b64).item()
    return num / denom if denom > 0 else num


# A relative L2 error against the float64 reference above this, where the reference's own is under GROSS_REF, is
# incorrect whatever the element-wise rule says: a red team's softmax that returned 1/N everywhere matched 99% of the
# elements of a 4096-wide row within atol=1e-2 (every probability is below it) and was crowned 5.7x. Its error is
# 0.79 on unit normal rows but 0.43 on the -|N(0, 1)| distribution; honest bf16 / fp8 outputs are near 1e-2.
GROSS_REL = 0.2
GROSS_REF = 0.05


def _gross_error(*, hp_rel: float | None, ref_rel: float | None, lp_rel: float | None,
                 ref_rel_known: float | None) -> str | None:  # fmt: skip
    """Why the output is grossly wrong while the reference itself is accurate (an output of cancellation noise, where
    honest kernels differ by 100%, has an inaccurate reference too and is left to the element-wise rule); None
    otherwise. Against the float64 reference where this check has one (``hp_rel``, ``ref_rel``); else against the
    reference itself (``lp_rel``), where an earlier check of the same workload and input distribution measured the
    reference's own error (``ref_rel_known``) and found it accurate: its error widens the bound. A red team's kernel
    returned a constant softmax only on calls past the first seed (the checked timed calls had no float64 run)."""
    if hp_rel is not None and ref_rel is not None:
        if hp_rel <= GROSS_REL or ref_rel >= GROSS_REF:
            return None
        return (
            f"relative L2 error {hp_rel:.3g} against the float64 reference (the reference's own: {ref_rel:.2g}): the "
            "output is wrong, passing element by element only where values are below atol"
        )
    if lp_rel is None or ref_rel_known is None or ref_rel_known >= GROSS_REF or lp_rel <= GROSS_REL + ref_rel_known:
        return None
    return (
        f"relative L2 error {lp_rel:.3g} against the reference (whose own against float64 was {ref_rel_known:.2g} on "
        "this workload and input distribution): the output is wrong, passing element by element only where values "
        "are below atol"
    )


def _scalar(name: str, out: Any, ref: Any, atol: float, rtol: float) -> Comparison:
    if isinstance(out, torch.Tensor) or not isinstance(out, int | float | bool):
        return Comparison(False, f"{name}: expected a Python scalar, got {type(out).__name__}")
    o, r = float(out), float(ref)
    if not (math.isfinite(o) and math.isfinite(r)):
        return Comparison(False, f"{name}: non-finite scalar (got {o}, reference {r})")
    if r != 0 and o == 0:
        return Comparison(False, f"{name}: output is zero, the reference is {r}")
    err = abs(o - r)
    ok = err <= atol + rtol * abs(r)
    return Comparison(ok, "" if ok else f"{name}: {out} != {ref} (atol={atol:g} rtol={rtol:g})", err, float(ok))


def compare_output(
    name: str,
    out: Any,
    ref: Any,
    ref_hp: Any | None,
    atol: float,
    rtol: float,
    ratio: float,
    *,
    max_error_cap: float | None = None,
    allow_negative_inf: bool = False,
    check_layout: bool = True,
    ref_rel_known: float | None = None,
) -> Comparison:
    """Compare one output with its reference under the harness's rule (module docstring). ``ref_rel_known``: the
    reference's own relative L2 error on this workload and input distribution, from an earlier check that had a
    float64 run, for the gross-error rule where this one has none (``_gross_error``)."""
    if not isinstance(ref, torch.Tensor):
        return _scalar(name, out, ref, atol, rtol)
    if not isinstance(out, torch.Tensor):
        return Comparison(False, f"{name}: expected a tensor, got {type(out).__name__}")
    if check_layout:
        err = layout_error(name, out, ref)
        if err:
            return Comparison(False, err)
    elif tuple(out.shape) != tuple(ref.shape) or out.dtype != ref.dtype:
        return Comparison(False, f"{name}: {tuple(out.shape)} {out.dtype}, expected {tuple(ref.shape)} {ref.dtype}")
    shape = tuple(ref.shape)
    of = out.detach().to(device=ref.device).reshape(-1)
    rf = ref.detach().reshape(-1)

    def chunk(lo: int):
        x = of[lo : lo + CHUNK].to(torch.float32)
        y = rf[lo : lo + CHUNK].to(torch.float32)
        both_neg_inf = (x == float("-inf")) & (y == float("-inf")) if allow_negative_inf else None
        x_bad, y_bad = ~torch.isfinite(x), ~torch.isfinite(y)
        nonzero = ((x != 0).any(), (y != 0).any())  # before the -inf pairs are set aside, as the harness's norms
        if both_neg_inf is not None:
            x_bad &= ~both_neg_inf
            y_bad &= ~both_neg_inf
            x, y = torch.where(both_neg_inf, 0.0, x), torch.where(both_neg_inf, 0.0, y)  # counted as neither
        diff = (x - y).abs()
        # The bound in float32, as the harness computes it; a non-finite difference (float32 overflow) fails.
        exceeds = (diff > atol + rtol * y.abs()) | ~torch.isfinite(diff)
        if both_neg_inf is not None:
            exceeds &= ~both_neg_inf
        return x, y, x_bad, y_bad, both_neg_inf, nonzero, diff, exceeds

    # In chunks, so that the float32 temporaries stay bounded for outputs of any size; every statistic is
    # element-wise (counts, max, any non-zero), so the verdict is the one of the whole tensor at once. The
    # statistics stay on the device until one read at the end: a read per statistic and chunk synchronised
    # the GPU some fifty times per output of a large workload.
    # the squared L2 norms for the gross-error rule against the reference itself, only where it can apply; reduced in
    # float64 without a float64 copy (the chunk's temporaries stay what the memory plan counts, COMPARE_BYTES_...)
    norms = ref_rel_known is not None and ref_rel_known < GROSS_REF
    stats = []
    for lo in range(0, of.numel(), CHUNK):
        x, y, x_bad, y_bad, bni, (xnz, ynz), diff, exceeds = chunk(lo)
        excluded = bni.sum() if bni is not None else torch.zeros((), device=x.device)
        worst = diff.max() if diff.numel() else torch.zeros((), device=x.device)
        if norms:
            sq = (torch.linalg.vector_norm(diff, dtype=torch.float64) ** 2,
                  torch.linalg.vector_norm(y, dtype=torch.float64) ** 2)  # fmt: skip
        else:
            sq = (excluded.new_zeros(()), excluded.new_zeros(()))
        parts = (x_bad.sum(), y_bad.sum(), xnz, ynz, excluded, exceeds.sum(), worst, *sq)
        stats.append(torch.stack([p.to(torch.float64) for p in parts]))
        del x, y, x_bad, y_bad, bni, diff, exceeds
    rows = torch.stack(stats).tolist() if stats else []
    n_x_bad = int(sum(r[0] for r in rows))
    n_y_bad = int(sum(r[1] for r in rows))
    x_nonzero = any(r[2] for r in rows)
    y_nonzero = any(r[3] for r in rows)
    total = of.numel() - int(sum(r[4] for r in rows))
    n_bad = int(sum(r[5] for r in rows))
    max_abs = max((r[6] for r in rows), default=0.0)
    sq_diff, sq_ref = sum(r[7] for r in rows), sum(r[8] for r in rows)
    lp_rel = math.sqrt(sq_diff) / math.sqrt(sq_ref) if norms and sq_ref > 0 else None
    first_bad = first_exceeding = None
    if n_x_bad:
        k = next(i for i, r in enumerate(rows) if r[0])
        x, y, x_bad, *_ = chunk(k * CHUNK)
        first_bad = _first_mismatches(x_bad, x, y, shape=shape, offset=k * CHUNK)
    elif n_bad and not n_y_bad:
        k = next(i for i, r in enumerate(rows) if r[5])
        x, y, *_, exceeds = chunk(k * CHUNK)
        first_exceeding = _first_mismatches(exceeds, x, y, shape=shape, offset=k * CHUNK)
    if n_x_bad or n_y_bad:
        if n_y_bad:
            msg = (
                f"{name}: the reference output has {n_y_bad} NaN/Inf values; NVIDIA's rule fails every output "
                "then (inputs invalid for the reference, e.g. an overflow)"
            )
        else:
            msg = f"{name}: {n_x_bad} NaN/Inf values in the output, {first_bad}"
        return Comparison(False, msg, matched_ratio=0.0)
    if y_nonzero and not x_nonzero:
        return Comparison(False, f"{name}: output is all zeros, the reference is not", matched_ratio=0.0)
    if total == 0:
        return Comparison(True, "", 0.0, 1.0, matched=0, total=0)
    matched = total - n_bad
    r = matched_ratio(matched, total)
    rel = ref_rel = None
    if isinstance(ref_hp, torch.Tensor) and tuple(ref_hp.shape) == tuple(out.shape):
        try:
            hp = ref_hp.detach().to(device=ref.device, dtype=torch.float64)
            if bool(torch.isfinite(hp).all()):
                rel = _rel(out.detach().to(device=ref.device), hp)
                ref_rel = _rel(rf.reshape(ref.shape), hp)
            del hp
        except Exception:  # noqa: BLE001 - a metric, never a reason to fail
            rel = ref_rel = None
    ok = r >= ratio
    why = []
    if not ok:
        why.append(f"{matched} of {total} elements ({r:.4%}) within atol={atol:g} rtol={rtol:g}, required {ratio:.4%}")
    gross = _gross_error(hp_rel=rel, ref_rel=ref_rel, lp_rel=lp_rel, ref_rel_known=ref_rel_known)
    if gross:
        ok = False
        why.append(gross)
    if max_error_cap is not None and max_abs > max_error_cap:
        ok = False
        why.append(f"max abs err {max_abs:.4g} exceeds the cap {max_error_cap:g}")
    if ok:
        return Comparison(True, "", max_abs, r, rel, matched, total, ref_rel)
    msg = f"{name}: {'; '.join(why)}; max abs err {max_abs:.4g}; {first_exceeding or 'no element beyond tolerance'}"
    return Comparison(False, msg, max_abs, r, rel, matched, total, ref_rel)
