"""Matrix-product einsums in a captured graph, rewritten as the permute / matmul the recognisers read
(kernelarc.graph.einsum): the rewritten graph computes what einsum does, other equations are left alone, and
attention written with einsum is recognised as attention."""

from __future__ import annotations

import pytest
import torch
from _problems import make_task
from torch.fx.experimental.proxy_tensor import make_fx

from kernelarc.families.composed import recognise
from kernelarc.graph import einsum
from kernelarc.graph.capture import trace
from kernelarc.graph.patterns import Kind

SHAPES = {"b": 2, "h": 3, "q": 5, "k": 7, "d": 4, "s": 6, "i": 5, "j": 3, "c": 4}

REWRITTEN = ["bhqd,bhkd->bhqk", "bhqk,bhkd->bhqd", "bsd,hd->bsh", "ij,jk->ik", "ik,jk->ij", "bij,bjk->bik",
             "bqhd,bkhd->bhqk", "bhqk,bkhd->bqhd", "ij,jk->ki", "bij,bkj->bki", "bsd,dh->bhs"]  # fmt: skip
KEPT = ["ii,ij->j", "ijk,jk->i", "i,i->", "bij,bjk", "...ij,...jk->...ik", "bij,bjc,bkc->bik", "bijc,bjkc->bik",
        "ij,kj->ijk"]  # fmt: skip


def _operands(eq: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(len(eq))
    return [torch.randn([SHAPES[c] for c in term], generator=g, dtype=torch.float64)
            for term in eq.split("->")[0].split(",")]  # fmt: skip


def _traced(eq: str, xs: list[torch.Tensor]) -> torch.fx.GraphModule:
    return make_fx(lambda *a: torch.einsum(eq, *a), pre_dispatch=True)(*xs)


def _einsums(gm: torch.fx.GraphModule) -> int:
    return sum(n.op == "call_function" and n.target is torch.ops.aten.einsum.default for n in gm.graph.nodes)


@pytest.mark.parametrize("eq", REWRITTEN)
def test_a_matrix_product_einsum_becomes_matmul_and_computes_the_same(eq):
    xs = _operands(eq)
    gm = _traced(eq, xs)
    assert _einsums(gm) == 1
    assert einsum.rewrite(gm) == 1
    assert _einsums(gm) == 0
    assert any(n.target is torch.ops.aten.matmul.default for n in gm.graph.nodes if n.op == "call_function")
    got = gm(*xs)
    want = torch.einsum(eq, *xs)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("eq", KEPT)
def test_other_equations_are_left_as_they_are(eq):
    assert einsum.plan(eq) is None


def test_the_rewritten_nodes_carry_shapes_for_the_recognisers():
    """Every new node has a fake value (shape, dtype) as traced nodes do, the einsum's output its own."""
    eq = "bqhd,bkhd->bhqk"
    q, k = (torch.empty(2, 5, 3, 4, device="meta", dtype=torch.bfloat16) for _ in range(2))
    gm = trace(lambda a, b: torch.einsum(eq, a, b), [q, k], symbolic=False)
    assert _einsums(gm) == 0
    for n in gm.graph.nodes:
        if n.op == "call_function":
            assert isinstance(n.meta.get("val"), torch.Tensor), n
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    out = out[0] if isinstance(out, tuple | list) else out
    assert tuple(out.meta["val"].shape) == (2, 3, 5, 5)


EINSUM_ATTENTION = """import torch

@torch.no_grad()
def run(q, k, v, pad):
    s = torch.einsum('bqhd,bkhd->bhqk', q, k) * (q.shape[-1] ** -0.5)
    s = s.masked_fill(pad[:, None, None, :], float('-inf'))
    p = torch.softmax(s.float(), dim=-1).to(q.dtype)
    return torch.einsum('bhqk,bkhd->bqhd', p, v)
"""


def test_attention_written_with_einsum_is_recognised_as_attention(tmp_path):
    """Scores as einsum over [B, S, H, D] tensors, a key-padding mask, softmax, einsum with the values: one
    attention site, with q and k read through the rewrite's permutes and the mask as a drop mask."""
    task = make_task(tmp_path, "p_einsum_attn", EINSUM_ATTENTION,
                     {"q": (["B", "S", "H", "D"], "bfloat16"), "k": (["B", "S", "H", "D"], "bfloat16"),
                      "v": (["B", "S", "H", "D"], "bfloat16"), "pad": (["B", "S"], "bool")},
                     {"out": (["B", "S", "H", "D"], "bfloat16")},
                     [{"B": 2, "S": 16, "H": 2, "D": 16}])  # fmt: skip
    rec = recognise(task)
    assert rec.capture is not None, rec.error
    sites = [s for s in rec.sites[0] if s.kind is Kind.attention]
    assert len(sites) == 1, rec.sites[0]
    assert sites[0].params["mask"] == "drop" and not sites[0].params["causal"]


def test_a_size_one_contracted_index_einsum_broadcasts_is_left_alone():
    """einsum broadcasts a contracted index of size 1 against the other operand's size; matmul does not (found by a
    review's fuzz: 'Ab,Af->fb' on [1, 3] and [3, 5])."""
    eq = "Ab,Af->fb"
    xs = [torch.randn(1, 3, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)]
    gm = _traced(eq, xs)
    assert einsum.rewrite(gm) == 0 and _einsums(gm) == 1
    torch.testing.assert_close(gm(*xs), torch.einsum(eq, *xs))
