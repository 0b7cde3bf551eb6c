"""compare_output: NVIDIA's acceptance rule (run side by side with their code), messages that never raise,
the output layout contract."""

import pytest
import torch
from shared_dirs import from_harness

from kernelarc.guard import compare
from kernelarc.guard.compare import _first_mismatches, compare_output, layout_error, matched_ratio, stride_mismatch


@pytest.fixture(scope="module")
def nvidia():
    """NVIDIA's correctness module and ToleranceSpec, imported from the vendored harness (torch + pydantic)."""
    (correctness,) = from_harness("sol_execbench.core.bench.correctness")
    (tolerance_spec,) = from_harness("sol_execbench.core.data.workload", "ToleranceSpec")
    return correctness, tolerance_spec


def _ref(dtype: torch.dtype, n: int = 4000, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    if dtype == torch.bool:
        return torch.rand(n, generator=g) < 0.5
    return torch.randint(-1000, 1000, (n,), generator=g).to(dtype)


def _perturb(ref: torch.Tensor, k: int, delta: float) -> torch.Tensor:
    """ref with its first k elements moved by delta (in float32, then back to the dtype)."""
    out = ref.to(torch.float32).clone()
    out[:k] += delta
    return out.to(ref.dtype)


def _cases():
    """(id, output, reference, tolerance dict) over dtypes and the rule's edges."""
    cases = []
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        ref = _ref(dt)
        n = ref.numel()
        cases += [
            (f"{dt}-exact", ref.clone(), ref, {}),
            (f"{dt}-within-atol", _perturb(ref, n, 0.004), ref, {"max_atol": 0.01, "max_rtol": 0.0}),
            (f"{dt}-beyond-atol", _perturb(ref, n, 0.5), ref, {"max_atol": 0.01, "max_rtol": 0.0}),
            (f"{dt}-within-rtol", (ref.float() * 1.004).to(dt), ref, {"max_atol": 1e-6, "max_rtol": 0.01}),
            (f"{dt}-beyond-rtol", (ref.float() * 1.05).to(dt), ref, {"max_atol": 1e-6, "max_rtol": 0.01}),
            # 4000 elements, 0.99 required: 40 may be off, 41 may not
            (f"{dt}-ratio-at", _perturb(ref, 40, 1.0), ref, {"required_matched_ratio": 0.99}),
            (f"{dt}-ratio-below", _perturb(ref, 41, 1.0), ref, {"required_matched_ratio": 0.99}),
            (f"{dt}-ratio-0.98-ok", _perturb(ref, 80, 1.0), ref, {"required_matched_ratio": 0.98}),
            (f"{dt}-ratio-0.98-bad", _perturb(ref, 81, 1.0), ref, {"required_matched_ratio": 0.98}),
            (f"{dt}-cap", _perturb(ref, 1, 3.0), ref, {"max_error_cap": 1.0}),
            (f"{dt}-under-cap", _perturb(ref, 1, 0.5), ref, {"max_error_cap": 1.0}),
            (f"{dt}-defaults", _perturb(ref, 30, 1.0), ref, {}),
            (f"{dt}-zeros", torch.zeros_like(ref), ref, {}),
        ]
        nan_out = ref.clone()
        nan_out[5] = float("nan")
        inf_out = ref.clone()
        inf_out[7] = float("inf")
        ninf_ref = ref.clone()
        ninf_ref[::2] = float("-inf")
        ninf_out = ninf_ref.clone()
        ninf_half = ninf_ref.clone()
        ninf_half[0] = 0.0
        nan_both = nan_out.clone()
        cases += [
            (f"{dt}-nan", nan_out, ref, {}),
            (f"{dt}-nan-both", nan_both, nan_out, {}),
            (f"{dt}-inf", inf_out, ref, {}),
            (f"{dt}-inf-in-ref", ref.clone(), inf_out, {}),
            (f"{dt}-neg-inf-both", ninf_out, ninf_ref, {}),
            (f"{dt}-neg-inf-allowed", ninf_out, ninf_ref, {"allow_negative_inf": True}),
            (f"{dt}-neg-inf-one-side", ninf_half, ninf_ref, {"allow_negative_inf": True}),
        ]
    for dt in (torch.int32, torch.int64, torch.int8):
        ref = _ref(dt) if dt != torch.int8 else _ref(torch.int64).clamp(-100, 100).to(dt)
        cases += [
            (f"{dt}-exact", ref.clone(), ref, {}),
            (f"{dt}-off-by-one", ref + 1, ref, {}),  # passes where 0.01 + 0.01*|ref| >= 1
            (f"{dt}-off-by-one-tight", ref + 1, ref, {"max_atol": 0.0, "max_rtol": 0.0, "required_matched_ratio": 1}),
            (f"{dt}-zeros", torch.zeros_like(ref), ref, {}),
        ]
    large = torch.randint(100, 1000, (4000,), generator=torch.Generator().manual_seed(1))
    cases.append(("int64-off-by-one-large", large + 1, large, {}))  # within rtol * |ref|: NVIDIA accepts
    big = torch.arange(2**24, 2**24 + 4000, dtype=torch.int64)
    exact = {"max_atol": 0.0, "max_rtol": 0.0, "required_matched_ratio": 1}
    cases.append(("int64-above-2^24", big + 1, big, exact))
    # compared in float32: 2**24 + 2k + 1 rounds onto its neighbour, so half of them "match"
    cases.append(("int64-above-2^24-float32", big + 1, big, {**exact, "required_matched_ratio": 0.4}))
    b = _ref(torch.bool)
    flipped = b.clone()
    flipped[:50] = ~flipped[:50]
    cases += [
        ("bool-exact", b.clone(), b, {}),
        ("bool-50-flipped", flipped, b, {}),
        ("bool-30-flipped", torch.where(torch.arange(4000) < 30, ~b, b), b, {}),
        ("bool-all-false", torch.zeros_like(b), b, {}),
    ]
    return cases


CASES = _cases()


@pytest.mark.parametrize("chunk", [None, 777], ids=["whole", "chunked"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_same_verdict_as_nvidias_harness(nvidia, case, chunk, monkeypatch):
    """Also in chunks smaller than the tensors: the verdict of a chunked comparison is the whole one's."""
    if chunk is not None:
        monkeypatch.setattr(compare, "CHUNK", chunk)
    correctness, ToleranceSpec = nvidia
    _, out, ref, tol = case
    spec = ToleranceSpec(**tol)
    _, exceeds = correctness.compute_error_stats(out, ref, spec)
    c = compare_output(
        "y",
        out,
        ref,
        None,
        spec.max_atol,
        spec.max_rtol,
        spec.required_matched_ratio,
        max_error_cap=spec.max_error_cap,
        allow_negative_inf=spec.allow_negative_inf,
    )
    assert c.ok is (not exceeds), c.message
    assert c.ok or c.message


def test_the_grid_holds_both_verdicts(nvidia):
    correctness, ToleranceSpec = nvidia
    verdicts = {not correctness.compute_error_stats(o, r, ToleranceSpec(**t))[1] for _, o, r, t in CASES}
    assert verdicts == {True, False}


def test_matched_ratio_is_counted_in_integers():
    # float32 means of a 0/1 mask are inexact past 2**24 elements; integer counts are not
    assert matched_ratio(16_254 * 2048, 16_254 * 2048) == 1.0
    assert matched_ratio(989, 1000) < 0.99 <= matched_ratio(990, 1000)
    assert matched_ratio(0, 0) == 1.0


def test_the_mismatch_message_never_raises():
    """Issue 13's crash: the old code asked a 939k-element tensor for .item() after the first-mismatch
    search returned () (a float32 mean put the ratio below 1 with nothing beyond tolerance)."""
    o = torch.randn(939_000)
    assert "no single element" in _first_mismatches(torch.zeros(939_000, dtype=torch.bool), o, o)
    mask = torch.zeros(3, 313_000, dtype=torch.bool)
    mask[2, 17] = mask[2, 99] = True
    msg = _first_mismatches(mask, o.reshape(3, -1), o.reshape(3, -1) + 1)
    assert "at (2, 17)" in msg and "at (2, 99)" in msg
    assert "unavailable" in _first_mismatches(mask, o[:5], o[:5])  # wrong sizes: a message, not a raise
    zero_d = torch.tensor(True)
    assert "at ()" in _first_mismatches(zero_d, torch.tensor(1.0), torch.tensor(2.0))


def test_a_large_output_below_the_ratio_gets_a_message_with_positions():
    ref = torch.randn(939_000, dtype=torch.bfloat16)
    out = ref.clone()
    out[123_456] += 5
    out[500_000:500_100] = 7  # 101 mismatches of 939k: below a ratio of 1.0, above 0.99
    c = compare_output("y", out, ref, None, 1e-2, 1e-2, 1.0)
    assert not c.ok and c.matched == 939_000 - 101 and c.total == 939_000
    assert "at (123456,)" in c.message and "938899 of 939000" in c.message
    assert compare_output("y", out, ref, None, 1e-2, 1e-2, 0.99).ok
    # positions are the tensor's, whichever chunk they fall in
    out2 = ref.clone().reshape(939, 1000)
    out2[700, 3] += 9
    c = compare_output("y", out2, ref.reshape(939, 1000), None, 1e-2, 1e-2, 1.0)
    assert "at (700, 3)" in c.message


def test_right_values_in_a_column_major_layout_are_incorrect():
    ref = torch.randn(64, 48)
    col_major = ref.t().contiguous().t()
    assert torch.equal(col_major, ref) and not col_major.is_contiguous()
    c = compare_output("y", col_major, ref, None, 1e-2, 1e-2, 0.99)
    assert not c.ok and "not contiguous row-major" in c.message
    assert compare_output("y", ref.clone(), ref, None, 1e-2, 1e-2, 0.99).ok
    # a reference that is itself a transposed view: its strides or row-major, nothing else
    ref_t = torch.randn(48, 64).t()
    assert compare_output("y", ref_t.clone(), ref_t, None, 1e-2, 1e-2, 0.99).ok  # clone keeps the strides
    assert layout_error("y", ref_t.contiguous(), ref_t) is None
    odd = torch.randn(64, 96)[:, ::2]
    assert "neither contiguous row-major nor the reference's" in layout_error("y", odd, ref_t)
    # size-1 dimensions may have any stride
    ref1 = torch.randn(1, 32)
    assert layout_error("y", torch.randn(32, 1).t(), ref1) is None
    assert "dtype" in layout_error("y", ref.double(), ref)
    assert "shape" in layout_error("y", ref[:2], ref)


def test_fp64_reference_is_a_metric_only():
    ref = torch.randn(1000, dtype=torch.bfloat16)
    hp = ref.double() + 0.003  # the float64 run disagrees a little with the bf16 reference
    c = compare_output("y", ref.clone(), ref, hp, 1e-2, 1e-2, 0.99)
    assert c.ok and c.rel_err is not None and c.rel_err > 0


def test_scalars():
    assert compare_output("s", 1.0005, 1.0, None, 1e-2, 1e-2, 0.99).ok
    assert not compare_output("s", 2.0, 1.0, None, 1e-2, 1e-2, 0.99).ok
    assert not compare_output("s", float("nan"), 1.0, None, 1e-2, 1e-2, 0.99).ok
    assert not compare_output("s", torch.tensor(1.0), 1.0, None, 1e-2, 1e-2, 0.99).ok


def test_stride_lists_follow_the_same_rule():
    assert not stride_mismatch([32, 1], [64, 1], (8, 32))  # row-major, the reference a split view
    assert not stride_mismatch([64, 1], [64, 1], (8, 32))  # the reference's own layout
    assert stride_mismatch([1, 8], [32, 1], (8, 32))  # column-major
    assert not stride_mismatch([5, 1], [1, 1], (1, 32))  # size-1 dimensions: any stride
