"""Recognition of the patterns KernelArc's families and libraries solve, in several writing styles."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernelarc.graph.capture import trace
from kernelarc.graph.catalog import recognize
from kernelarc.graph.patterns import Kind, Site

BF16, F32, F16 = torch.bfloat16, torch.float32, torch.float16


def _meta(*shape, dtype=BF16):
    return torch.empty(*shape, dtype=dtype, device="meta")


def sites(fn, *args, symbolic: bool = True) -> list[Site]:
    return recognize(trace(fn, args, symbolic=symbolic).graph.owning_module)


def kinds(found: list[Site]) -> list[Kind]:
    return [s.kind for s in found if s.kind not in (Kind.elementwise, Kind.reduction)]


def one(found: list[Site], kind: Kind) -> Site:
    got = [s for s in found if s.kind is kind]
    assert len(got) == 1, [s.describe() for s in found]
    return got[0]


# ---- RMSNorm ------------------------------------------------------------------------------


def rms_manual(hidden, gamma):
    x = hidden.to(torch.float32)
    return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma.float()).to(hidden.dtype)


def rms_square_div(a, w):
    var = (a * a).mean(dim=-1, keepdim=True)
    return w * (a / torch.sqrt(var + 1e-6))


def rms_square_recip(a, w):
    return w * (a * (1.0 / torch.sqrt((a * a).mean(dim=-1, keepdim=True) + 1e-6)))


def rms_functional(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, 2e-6)


@pytest.mark.parametrize(
    ("fn", "dtype", "eps"),
    [(rms_manual, BF16, 1e-5), (rms_square_recip, F32, 1e-6), (rms_square_div, F32, 1e-6), (rms_functional, F16, 2e-6)],
)
def test_rmsnorm_styles(fn, dtype, eps):
    found = sites(fn, _meta(3, 5, 64, dtype=dtype), _meta(64, dtype=dtype))
    s = one(found, Kind.rmsnorm)
    assert s.params["eps"] == pytest.approx(eps)
    assert s.inputs["x"].op == "placeholder" and s.inputs["weight"].op == "placeholder"


def test_mean_square_without_a_weight_is_not_an_rmsnorm():
    # no per-channel weight: nothing the RMSNorm families compute; left to the rest of the graph
    fn = lambda a: a * torch.rsqrt((a * a).mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    assert Kind.rmsnorm not in kinds(sites(fn, _meta(4, 64, dtype=F32)))


def add_rms(x, residual, w):
    s = x.float() + residual.float()
    y = s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()
    return y.to(x.dtype), s.to(x.dtype)


def test_fused_add_rmsnorm_with_residual_out():
    found = sites(add_rms, _meta(6, 128), _meta(6, 128), _meta(128))
    s = one(found, Kind.add_rmsnorm)
    assert "residual_out" in s.extra_outputs
    assert {s.inputs["x"].name, s.inputs["residual"].name} == {"x_1", "residual_1"}


# ---- GEMM ---------------------------------------------------------------------------------


def linear_bias_gelu(inp, weight, bias):
    return F.gelu(F.linear(inp, weight, bias), approximate="tanh")


def matmul_residual(a, w, r):
    return a @ w.T + r


def matmul_kn(a, b):
    return torch.mm(a, b) * 0.5


def test_gemm_epilogues_and_layouts():
    s = one(sites(linear_bias_gelu, _meta(2, 8, 32), _meta(16, 32), _meta(16)), Kind.gemm)
    assert (s.params["layout"], s.params["bias"], s.params["epilogue"]) == ("nk", True, "gelu_tanh")
    s = one(
        sites(matmul_residual, _meta(8, 32, dtype=F16), _meta(16, 32, dtype=F16), _meta(8, 16, dtype=F16)), Kind.gemm
    )
    assert (s.params["layout"], s.params["epilogue"]) == ("nk", "residual")
    s = one(sites(matmul_kn, _meta(8, 32, dtype=F32), _meta(32, 16, dtype=F32)), Kind.gemm)
    assert (s.params["layout"], s.params["epilogue"], s.params["scale"]) == ("kn", "scale", 0.5)


# ---- attention ----------------------------------------------------------------------------


def sdpa_causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def explicit_causal(query, key, value):
    s = query.shape[-2]
    scores = torch.matmul(query.float(), key.float().transpose(-1, -2)) * (1.0 / math.sqrt(query.shape[-1]))
    keep = torch.ones(s, s, dtype=torch.bool, device=query.device).tril()
    scores = scores.masked_fill(~keep, float("-inf"))
    return (torch.softmax(scores, dim=-1) @ value.float()).to(query.dtype)


def explicit_additive(q, k, v, bias):
    return torch.softmax(q @ k.transpose(2, 3) / 8.0 + bias, dim=-1) @ v


@pytest.mark.parametrize("symbolic", [True, False])
def test_attention_styles(symbolic):
    q = _meta(2, 4, 32, 16)
    s = one(sites(sdpa_causal, q, _meta(2, 4, 32, 16), _meta(2, 4, 32, 16), symbolic=symbolic), Kind.attention)
    assert s.params["causal"] and s.params["style"] == "sdpa"
    s = one(sites(explicit_causal, q, _meta(2, 4, 32, 16), _meta(2, 4, 32, 16), symbolic=symbolic), Kind.attention)
    assert s.params["causal"] and s.params["mask"] == "none"
    assert s.params["scale"] == pytest.approx(0.25)
    assert (s.params["in_dtype"], s.params["q_src_dtype"]) == ("float32", "bfloat16")
    args = (_meta(1, 2, 8, 64, dtype=F32), _meta(1, 2, 8, 64, dtype=F32), _meta(1, 2, 8, 64, dtype=F32))
    s = one(sites(explicit_additive, *args, _meta(1, 1, 8, 8, dtype=F32), symbolic=symbolic), Kind.attention)
    assert (s.params["mask"], s.params["causal"]) == ("add", False)
    assert s.params["scale"] == pytest.approx(1 / 8)


# ---- softmax, GLU, RoPE, LayerNorm, leftovers -----------------------------------------------


def softmax_manual(logits):
    z = logits - logits.amax(dim=-1, keepdim=True)
    e = torch.exp(z)
    return e / e.sum(dim=-1, keepdim=True)


def test_softmax_styles():
    assert one(sites(lambda x: torch.softmax(x.float(), -1).to(x.dtype), _meta(4, 50)), Kind.softmax)
    assert one(sites(softmax_manual, _meta(4, 50, dtype=F32)), Kind.softmax)
    # softmax over another dim is not the row softmax the families compute
    assert Kind.softmax not in kinds(sites(lambda x: torch.softmax(x, 0), _meta(4, 50)))


def swiglu_chunk(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu_slices(x):
    n = x.shape[-1] // 2
    g = x[..., :n].float()
    return (g * torch.sigmoid(g) * x[..., n:].float()).to(x.dtype)


def geglu_two_tensors(a, b):
    return F.gelu(a, approximate="tanh") * b


def test_glu_styles():
    s = one(sites(swiglu_chunk, _meta(3, 7, 48)), Kind.glu)
    assert (s.params["act"], s.params["packed"]) == ("silu", True)
    s = one(sites(swiglu_slices, _meta(5, 48)), Kind.glu)
    assert (s.params["act"], s.params["packed"]) == ("silu", True)
    s = one(sites(geglu_two_tensors, _meta(5, 24, dtype=F32), _meta(5, 24, dtype=F32)), Kind.glu)
    assert (s.params["act"], s.params["packed"]) == ("gelu_tanh", False)


def rope_rotate_half(x, cos, sin):
    h = x.shape[-1] // 2
    rot = torch.cat([-x[..., h:], x[..., :h]], dim=-1)
    return x * cos + rot * sin


def test_rope_and_layernorm():
    assert one(sites(rope_rotate_half, _meta(2, 4, 8, 16), _meta(8, 16), _meta(8, 16)), Kind.rope)
    # aten.layer_norm over the last axis: an op of a fused region (as a library site it would be itself); over
    # more axes it stays a LayerNorm site
    s = one(sites(lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5), _meta(4, 32), _meta(32), _meta(32)),
            Kind.fused)  # fmt: skip
    assert "layer_norm" in {n.target.overloadpacket.__name__ for n in s.nodes}
    s = one(sites(lambda x: F.layer_norm(x, x.shape[-2:], eps=1e-5), _meta(4, 8, 32)), Kind.layernorm)
    assert s.params["eps"] == 1e-5 and s.params["dims"] == 2

    def manual_ln(x, w, b):
        mu = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mu) * torch.rsqrt(var + 1e-6) * w + b

    s = one(sites(manual_ln, _meta(4, 32, dtype=F32), _meta(32, dtype=F32), _meta(32, dtype=F32)), Kind.layernorm)
    assert s.params["eps"] == 1e-6 and s.inputs["bias"] is not None

    def unbiased_ln(x, w, b):  # torch.var's default: not what F.layer_norm computes (a fused region instead)
        return (x - x.mean(-1, keepdim=True)) * torch.rsqrt(x.var(-1, keepdim=True) + 1e-6) * w + b

    found = sites(unbiased_ln, _meta(4, 32, dtype=F32), _meta(32, dtype=F32), _meta(32, dtype=F32))
    assert Kind.layernorm not in [f.kind for f in found] and [f.kind for f in found] == [Kind.fused]


def test_elementwise_chain_and_reduction_fused_or_left_over():
    """An elementwise chain ending in a last-axis sum is one fused region; in float64, which the generated kernels do
    not compute, the chain and the reduction are left over (reported, not substituted)."""
    chain = lambda x, y: (torch.tanh(x) * y + 1.0).sum(-1)  # noqa: E731
    found = sites(chain, _meta(4, 32, dtype=F32), _meta(4, 32, dtype=F32))
    assert [s.kind for s in found] == [Kind.fused] and found[0].params["reductions"] == 1
    found = sites(chain, _meta(4, 32, dtype=torch.float64), _meta(4, 32, dtype=torch.float64))
    assert Kind.elementwise in [s.kind for s in found] and Kind.reduction in [s.kind for s in found]


def test_unrolled_python_loops_are_refused(monkeypatch):
    import kernelarc.graph.capture as capture

    def scan(x):
        acc = x[:, 0]
        for t in range(1, x.shape[1]):
            acc = torch.maximum(acc * 0.5, x[:, t])
        return acc

    monkeypatch.setattr(capture, "MAX_GRAPH_NODES", 40)
    with pytest.raises(capture.GraphTooLarge):
        trace(scan, (_meta(2, 64, dtype=F32),), symbolic=False)
    assert trace(scan, (_meta(2, 8, dtype=F32),), symbolic=False) is not None


def test_a_long_python_loop_is_refused_before_it_is_unrolled(monkeypatch):
    """The trace stops after a bounded number of torch calls, not after unrolling every step."""
    import kernelarc.graph.capture as capture

    steps = []

    def scan(x):
        acc = x[:, 0]
        for t in range(1, x.shape[1]):
            steps.append(t)
            acc = torch.maximum(acc * 0.5, x[:, t])
        return acc

    monkeypatch.setattr(capture, "MAX_GRAPH_NODES", 40)
    with pytest.raises(capture.GraphTooLarge, match="stopped after"):
        trace(scan, (_meta(2, 5000, dtype=F32),), symbolic=True)
    assert len(steps) < 200  # about 3 x 40 calls, 3 calls a step: stopped near step 40 of 4999


def test_a_long_python_loop_is_refused_without_tracing(monkeypatch):
    """The call budget is checked on a plain run over meta tensors first: a per-step loop is refused
    before make_fx traces a single step (L1/094: 34 s of tracing out of a 90 s budget before)."""
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    import kernelarc.graph.capture as capture

    def scan(x):
        acc = x[:, 0]
        for t in range(1, x.shape[1]):
            acc = torch.maximum(acc * 0.5, x[:, t])
        return acc

    def no_tracing(*a, **k):
        raise AssertionError("make_fx was called for a loop the call budget refuses")

    monkeypatch.setattr(capture, "MAX_GRAPH_NODES", 40)
    monkeypatch.setattr(proxy_tensor, "make_fx", no_tracing)
    with pytest.raises(capture.GraphTooLarge, match="stopped after"):
        trace(scan, (_meta(2, 5000, dtype=F32),), symbolic=False)
    with pytest.raises(capture.CaptureError, match="make_fx was called"):  # a short loop goes on to be traced
        trace(scan, (_meta(2, 8, dtype=F32),), symbolic=False)
