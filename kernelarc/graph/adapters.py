"""Adapters: how a recognised site's graph values map onto a kernel family's or library's interface.

An adapter turns a ``Site`` into the lines of Python that compute the site's outputs inside a
composed candidate: which graph value is the family's ``x`` / ``weight`` / ``A`` / ``B``, how the
problem's axes are flattened onto the family's 2-D (or 4-D) layout, the eps / scale / activation
the site carries, and the casts back to the dtypes the rest of the graph reads. Every family path
is guarded at run time by the family's preconditions (dtype, contiguity, scale, shapes) with the
library path as the fallback, so a composed candidate is correct for inputs the family does not
cover.

``Impl`` names the implementation chosen for a site kind (a knob of the composed family):
``graph`` (the reference's own ops), ``library`` (a fused PyTorch / cuBLASLt / cuDNN call) or
``family`` (a KernelArc kernel, whose rendered module is a part of the candidate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import torch

from kernelarc.graph.patches import (  # noqa: F401 - re-exported: the composition reaches them through adapters
    GLU_TRITON,
    AdapterError,
    patch_eps,
    patch_glu_act,
    patch_glu_pair,
    patch_glu_round_act,
    patch_rope_full_cos,
    patch_rope_interleaved,
)
from kernelarc.graph.patterns import Kind, Site


class Impl(StrEnum):
    graph = "graph"
    library = "library"
    family = "family"


# Built-in task whose kernel families can serve a site of this kind, with the precondition the
# site must meet (checked at composition time; run-time checks are emitted with the call).
FAMILY_TASK: dict[Kind, str] = {
    Kind.rmsnorm: "rmsnorm",
    Kind.add_rmsnorm: "fused_add_rmsnorm",
    Kind.gemm: "matmul",
    Kind.fp8_gemm: "fp8_matmul",
    Kind.softmax: "softmax",
    Kind.glu: "swiglu",
    Kind.attention: "attention",
    Kind.rope: "rope",
    Kind.scatter_add: "scatter_add",
    Kind.group_norm: "group_norm",
    Kind.counting_sort: "counting_sort",
}
LIBRARY_KINDS = {Kind.rmsnorm, Kind.add_rmsnorm, Kind.layernorm, Kind.gemm, Kind.attention, Kind.softmax}

SDPA_BACKENDS = ("auto", "flash", "efficient", "cudnn", "math")
_BACKEND_ENUM = {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                 "math": "MATH"}  # fmt: skip
LOW_DTYPES = ("bfloat16", "float16")
_SDPB = "torch.nn.attention.SDPBackend"
_NNF = "torch.nn.functional"


@dataclass(frozen=True)
class Ctx:
    """What an adapter needs besides the site: names of graph values, the family part's prefix, knobs."""

    name: Callable[[Any], str]  # graph value -> expression
    part: str | None  # prefix of the family part's module names ("_k0_"), None without a family
    knobs: dict[str, Any]
    fallback: Callable[[], list[str]] | None = None  # the site's own nodes as lines (computing the outputs)


def family_ok(site: Site) -> str | None:
    """Why a family kernel cannot serve ``site`` (None when it can)."""
    p = site.params
    if site.kind in (Kind.fused, Kind.dwconv):
        return None  # recognised only in the forms its generated kernel takes
    if site.kind not in FAMILY_TASK:
        return f"no KernelArc family for {site.kind.value}"
    if site.kind is Kind.gemm and p["dtype"] == "float32":
        k = p.get("k")
        if isinstance(k, int) and k < 16:
            return f"an fp32 GEMM with K={k} is an outer product: no tensor-core work for the split-precision family"
        return None  # matmul_f32: any layout, batched
    if site.kind is Kind.gemm:
        if p["layout"] != "nk" or p["batched"]:
            return "GEMM family needs A [.., K] @ B[N, K]^T (not batched, B in weight layout)"
        if p["dtype"] not in LOW_DTYPES:
            return f"GEMM family computes in bf16/fp16 (fp32 on matmul_f32), the site is {p['dtype']}"
    if site.kind is Kind.fp8_gemm and p.get("mode") not in ("block", "outer"):
        return "fp8 GEMM families read 1x128 / 128x128 blockwise, per-row or per-tensor scales"
    if site.kind is Kind.glu and p["act"] not in GLU_TRITON:
        return "SwiGLU family computes act(gate) * up with act one of " + ", ".join(GLU_TRITON)
    if site.kind is Kind.rope and not rope_on_family(p):
        return (
            "RoPE families rotate halves with cos / sin equal on both halves, or interleaved pairs with one "
            "cos / sin value per pair (not arbitrary full-width cos / sin, not complex128 or other layouts)"
        )
    if site.kind is Kind.attention and p.get("style") == "varlen":
        return "varlen attention runs per segment on SDPA"
    if site.kind is Kind.attention and p.get("dropout") not in (0.0, None):
        return "attention family takes no dropout"
    if site.kind is Kind.attention and p["mask"] not in ("none", "drop", "keep", "add"):
        return f"attention family takes no {p['mask']} mask"
    if site.kind is Kind.attention and p["mask"] != "none" and not key_padding_mask(site.inputs.get("mask")):
        return "attention family takes a key-padding mask only ([B or 1, 1, 1, S]), not one per query"
    return None


def key_padding_mask(mask: Any) -> bool:
    """The attention mask (as traced) holds one value per batch row and key: shape [B or 1, 1, 1, S]."""
    from kernelarc.graph.capture import node_shape, static_int

    shape = node_shape(mask) if mask is not None else None
    return shape is not None and len(shape) == 4 and static_int(shape[1]) == 1 and static_int(shape[2]) == 1


def _dt(name: str) -> str:
    return f"torch.{name}"


def _out(site: Site, expr: str, dtype_key: str = "out_dtype") -> str:
    dt = site.params.get(dtype_key)
    return f"{expr}.to({_dt(dt)})" if dt and dt != "None" else expr


# ------------------------------------------------------------------------------------------
# per kind: lines computing the site's outputs into ``out`` (and ``extra`` names)


def rmsnorm_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    x, w = c.name(site.inputs["x"]), c.name(site.inputs["weight"])
    eps = float(site.params["eps"])
    fused = site.kind is Kind.add_rmsnorm
    lines: list[str] = []
    if fused:
        r = c.name(site.inputs["residual"])
        lines.append(f"_s = {x}.to(torch.float32) + {r}.to(torch.float32)")
        if site.params.get("sum_dtype") not in (None, "float32"):
            lines[-1] = f"_s = ({x} + {r}).to(torch.float32)"
        src = "_s"
    else:
        src = x
    if impl is Impl.library:
        f32 = "torch.float32"
        call = f"{_NNF}.rms_norm({src}.to({f32}), ({src}.shape[-1],), {w}.to({f32}), {eps!r})"
        lines.append(f"{out} = {_out(site, call)}")
        if "residual_out" in extra:
            lines.append(f"{extra['residual_out']} = _s.to({_dt(site.params['sum_dtype'])})")
        return lines
    if impl is not Impl.family or c.part is None:
        raise AdapterError("rmsnorm: no implementation")
    p = c.part
    if fused:
        r = c.name(site.inputs["residual"])
        lines = [
            f"if {x}.shape == {r}.shape and {x}.dtype == {r}.dtype and {w}.dim() == 1:",
            # the sum is stored only where the graph reads it back (a third of the kernel's traffic otherwise)
            f"    _y, _ro = {p}run({x}.reshape(-1, {x}.shape[-1]), {r}.reshape(-1, {r}.shape[-1]), {w}, "
            f"store_residual={'residual_out' in extra})",
            f"    {out} = {_out(site, f'_y.view({x}.shape)')}",
        ]
        if "residual_out" in extra:
            lines.append(f"    {extra['residual_out']} = _ro.view({x}.shape).to({_dt(site.params['sum_dtype'])})")
        lines.append("else:")
        lines += ["    " + ln for ln in rmsnorm_lines(site, Impl.library, c, out, extra)]
        return lines
    return [
        f"if {w}.dim() == 1 and {x}.shape[-1] == {w}.shape[0]:",
        f"    {out} = {_out(site, f'{p}run({x}.reshape(-1, {x}.shape[-1]), {w}).view({x}.shape)')}",
        "else:",
        *["    " + ln for ln in rmsnorm_lines(site, Impl.library, c, out, extra)],
    ]


def layernorm_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    if impl is not Impl.library:
        raise AdapterError("layernorm: only the library implementation")
    x = c.name(site.inputs["x"])
    w = c.name(site.inputs["weight"]) if site.inputs.get("weight") is not None else "None"
    b = c.name(site.inputs["bias"]) if site.inputs.get("bias") is not None else "None"
    dims = site.params.get("dims") or 1
    shape = f"tuple({x}.shape[-{dims}:])"
    return [f"{out} = torch.nn.functional.layer_norm({x}, {shape}, {w}, {b}, {float(site.params['eps'])!r})"]


def softmax_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    x = c.name(site.inputs["x"])
    lib = f"{out} = {_out(site, f'torch.softmax({x}, -1, dtype=torch.float32)')}"
    if impl is Impl.library:
        return [lib]
    if impl is not Impl.family or c.part is None:
        raise AdapterError("softmax: no implementation")
    return [
        f"if {x}.dim() >= 1 and {x}.numel() > 0:",
        f"    {out} = {_out(site, f'{c.part}run({x}.reshape(-1, {x}.shape[-1])).view({x}.shape)')}",
        "else:",
        f"    {lib}",
    ]


# the gate activations in torch (their Triton forms: GLU_TRITON)
GLU_TORCH = {"silu": f"{_NNF}.silu({{}})", "gelu_tanh": f"{_NNF}.gelu({{}}, approximate='tanh')",
             "gelu_none": f"{_NNF}.gelu({{}})", "relu": "torch.relu({})", "sigmoid": "torch.sigmoid({})"}  # fmt: skip


def _glu_pair_lines(site: Site, c: Ctx, out: str) -> list[str]:
    g, u = c.name(site.inputs["gate"]), c.name(site.inputs["up"])
    gate = GLU_TORCH[site.params["act"]].format(f"{g}.to(torch.float32)")
    lib = f"{out} = {_out(site, f'({gate} * {u}.to(torch.float32))')}"
    fam = f"{c.part}run({g}.reshape(-1, {g}.shape[-1]), {u}.reshape(-1, {u}.shape[-1])).view({g}.shape)"
    return [
        f"if {g}.shape == {u}.shape and {g}.dtype == {u}.dtype and {g}.dim() >= 1 and {g}.numel() > 0:",
        f"    {out} = {_out(site, fam)}",
        "else:",
        f"    {lib}",
    ]


def glu_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    if impl is not Impl.family or c.part is None:
        raise AdapterError("glu: only the family implementation (the graph form is the library one)")
    if not site.params.get("packed"):
        return _glu_pair_lines(site, c, out)
    x = c.name(site.inputs["x"])
    h = f"{x}.shape[-1] // 2"
    gate = GLU_TORCH[site.params["act"]].format(f"{x}[..., :{h}].to(torch.float32)")
    act = f"{gate} * {x}[..., {h}:].to(torch.float32)"
    lib = f"{out} = {_out(site, f'({act})')}"
    fam = f"{c.part}run({x}.reshape(-1, {x}.shape[-1])).view(*{x}.shape[:-1], {h})"
    return [
        f"if {x}.shape[-1] % 2 == 0 and {x}.numel() > 0:",
        f"    {out} = {_out(site, fam)}",
        "else:",
        f"    {lib}",
    ]


def _epilogue(site: Site, c: Ctx, acc: str) -> list[str]:
    """The GEMM epilogue (bias, activation, scale, residual) applied to ``acc`` in the graph's order."""
    lines: list[str] = []
    p = site.params
    if p["bias"]:
        lines.append(f"{acc} = {acc} + {c.name(site.inputs['bias'])}")
    for e in p["epilogue"].split("+") if p["epilogue"] != "none" else []:
        if e == "scale":
            lines.append(f"{acc} = {acc} * {p['scale']!r}")
        elif e == "residual":
            lines.append(f"{acc} = {acc} + {c.name(site.inputs['residual'])}")
        elif e.startswith("gelu_"):
            lines.append(f"{acc} = torch.nn.functional.gelu({acc}, approximate={e[5:]!r})")
        else:
            fn = f"torch.{e}" if e in ("relu", "sigmoid", "tanh") else f"{_NNF}.{e}"
            lines.append(f"{acc} = {fn}({acc})")
    return lines


def gemm_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    p = site.params
    a, b = c.name(site.inputs["a"]), c.name(site.inputs["b"])
    if impl is Impl.library:
        # fused cuBLASLt epilogues: bias (+ relu / tanh-gelu) through addmm / _addmm_activation,
        # residual (+ scale) through addmm's beta*C + alpha*A@B
        if p["layout"] != "nk" or p["batched"]:
            raise AdapterError("gemm library path needs B in weight layout, not batched")
        epi = p["epilogue"]
        a2 = f"{a}.reshape(-1, {a}.shape[-1])"
        shape = f"(*{a}.shape[:-1], {b}.shape[0])"
        if p["bias"] and epi in ("none", "relu", "gelu_tanh", "gelu_none"):
            bias = c.name(site.inputs["bias"])
            mm = f"torch.addmm({bias}, {a2}, {b}.t())"
            if epi == "none":
                return [f"{out} = {mm}.view({shape})"]
            if epi == "relu":
                return [f"{out} = torch._addmm_activation({bias}, {a2}, {b}.t()).view({shape})"]
            if epi == "gelu_none":
                return [f"{out} = torch.nn.functional.gelu({mm}).view({shape})"]
            # cuBLASLt's GELU epilogue is the tanh form; on the CPU _addmm_activation applies the erf form
            return [
                f"if {bias}.is_cuda:",
                f"    {out} = torch._addmm_activation({bias}, {a2}, {b}.t(), use_gelu=True).view({shape})",
                "else:",
                f"    {out} = torch.nn.functional.gelu({mm}, approximate='tanh').view({shape})",
            ]
        if not p["bias"] and epi in ("residual", "scale+residual"):
            res = c.name(site.inputs["residual"])
            alpha = p["scale"] if epi == "scale+residual" else 1.0
            return [
                f"{out} = torch.addmm({res}.reshape(-1, {res}.shape[-1]), {a2}, {b}.t(), alpha={alpha!r}).view({shape})"
            ]
        raise AdapterError(f"gemm library path: no fused form for bias={p['bias']} epilogue={epi}")
    if impl is not Impl.family or c.part is None:
        raise AdapterError("gemm: no implementation")
    if p["dtype"] == "float32":  # matmul_f32 reads any strides and batch dims: B^T as a view of the site's B
        bnk = b if p["layout"] == "nk" else f"{b}.transpose(-1, -2)"
        ref = f"torch.matmul({a}, {b}.transpose(-1, -2))" if p["layout"] == "nk" else f"torch.matmul({a}, {b})"
        lines = [
            f"if {a}.dtype == torch.float32 and {b}.dtype == torch.float32 and {a}.dim() >= 2 and {b}.dim() >= 2:",
            f"    _c = {c.part}run({a}, {bnk})",
            "else:",
            f"    _c = {ref}",
        ]
        return [*lines, *_epilogue(site, c, "_c"), f"{out} = _c"]
    lines = [
        f"if {a}.dtype == {b}.dtype and {a}.dtype in (torch.bfloat16, torch.float16) and {b}.dim() == 2:",
        f"    _c = {c.part}run({a}.reshape(-1, {a}.shape[-1]), {b}).view(*{a}.shape[:-1], {b}.shape[0])",
        "else:",
        f"    _c = torch.matmul({a}, {b}.transpose(-1, -2))",
    ]
    lines += _epilogue(site, c, "_c")
    lines.append(f"{out} = _c")
    return lines


def fp8_gemm_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    """The fp8 GEMM family on the quantised operands and their scales (the family dequantises in its
    K loop), the bias and the output cast as the graph has them; the site's own ops (dequantise, fp32
    matmul) for shapes or dtypes outside what the family reads."""
    if impl is not Impl.family or c.part is None or c.fallback is None:
        raise AdapterError("fp8_gemm: only the family implementation (the graph's ops otherwise)")
    p = site.params
    qa, sa, qb, sb = (c.name(site.inputs[r]) for r in ("qa", "sa", "qb", "sb"))
    e4m3 = "torch.float8_e4m3fn"
    cond = [f"{qa}.dim() == 2", f"{qb}.dim() == 2", f"{qa}.dtype == {e4m3}", f"{qb}.dtype == {e4m3}",
            f"{qa}.shape[1] == {qb}.shape[1]"]  # fmt: skip
    if p["mode"] == "block":
        blk = 128
        cond += [f"{qa}.shape[1] % {blk} == 0", f"{qb}.shape[0] % {blk} == 0",
                 f"tuple({sa}.shape) == ({qa}.shape[0], {qa}.shape[1] // {blk})",
                 f"tuple({sb}.shape) == ({qb}.shape[0] // {blk}, {qa}.shape[1] // {blk})"]  # fmt: skip
        # the dequantised operands are reshaped back to the quantised tensors' shapes
        for q, role in ((qa, "a"), (qb, "b")):
            for i, v in enumerate(p[f"back_{role}"]):
                if isinstance(v, str):
                    cond.append(f"{q}.shape[{i}] == {c.name(site.inputs[v])}")
                elif v != -1:
                    cond.append(f"{q}.shape[{i}] == {int(v)}")
    else:
        cond += [f"{sa}.numel() in (1, {qa}.shape[0])", f"{sb}.numel() in (1, {qb}.shape[0])",
                 f"{sa}.dim() <= 2", f"{sb}.dim() <= 2"]  # fmt: skip
    lines = [f"if {' and '.join(cond)}:", f"    _c = {c.part}run({qa}, {qb}, {sa}, {sb})"]
    if p["bias"]:
        lines.append(f"    _c = _c.to({_dt(p['acc_dtype'])}) + {c.name(site.inputs['bias'])}")
    lines.append(f"    {out} = {_out(site, '_c')}")
    return [*lines, "else:", *["    " + ln for ln in c.fallback()]]


def _scale_product(site: Site, c: Ctx, const: float, nodes: int) -> str:
    """``const`` times / over the first ``nodes`` size factors the graph computed (d ** -0.5), as an expression."""
    expr = repr(float(const))
    for i, o in enumerate(site.params.get("scale_ops", [])[:nodes]):
        expr += f" {'*' if o == 'mul' else '/'} {c.name(site.inputs[f'scale{i}'])}"
    return expr


def _scale_expr(site: Site, c: Ctx) -> str | None:
    """The softmax scale as an expression: a constant times / over sizes the graph computed (d ** -0.5)."""
    p = site.params
    if p.get("scale") is None:
        return None
    return _scale_product(site, c, p["scale"], len(p.get("scale_ops", [])))


def _mask_scale_expr(site: Site, c: Ctx) -> str | None:
    """The scale applied to an additive mask (the scales after it: ``(qk * a + mask) * b`` scales it by ``b``), as
    an expression; None where the mask is added after every scale."""
    p = site.params
    if not p.get("mask_scaled"):
        return None
    return _scale_product(site, c, p.get("mask_scale", 1.0), int(p.get("mask_scale_nodes", 0)))


def _causal_mask(q: str, k: str) -> str:
    """The top-left aligned causal keep-mask [Sq, Sk] (query i sees keys j <= i) as an expression."""
    return f"torch.ones({q}.shape[-2], {k}.shape[-2], dtype=torch.bool, device={q}.device).tril()"


def _sdpa_call(site: Site, c: Ctx, q: str, k: str, v: str, cast: str | None) -> str:
    p = site.params
    mask = site.inputs.get("mask")
    m = "None"
    scale = _scale_expr(site, c)
    causal = bool(p["causal"])
    if mask is not None:
        m = c.name(mask)
        if p["mask"] == "drop":
            m = f"torch.logical_not({m})"
        elif p["mask"] == "add":
            ms = _mask_scale_expr(site, c)
            if ms is not None:  # (scores + mask) * scale: SDPA adds the mask after scaling
                m = f"({m} * ({ms}))"
            if cast:  # finite in the low dtype: fp32's finfo.min would become -inf there (a padded row then NaN)
                m = f"{m}.clamp_min(torch.finfo({cast}).min).to({cast})"
        if causal:  # SDPA takes no attn_mask with is_causal=True: the causal part goes into the mask
            keep = _causal_mask(q, k)
            m = f"({m} & {keep})" if p["mask"] in ("drop", "keep") else f"torch.where({keep}, {m}, float('-inf'))"
            causal = False
    args = f"{q}, {k}, {v}, attn_mask={m}, is_causal={causal}"
    if scale is not None:
        args += f", scale={scale}"
    if p.get("gqa"):
        args += ", enable_gqa=True"
    return f"torch.nn.functional.scaled_dot_product_attention({args})"


def _backend_wrap(c: Ctx, lines: list[str]) -> list[str]:
    backend = c.knobs.get("sdpa_backend", "auto")
    if backend == "auto":
        return lines
    enum = _BACKEND_ENUM[backend]
    return [f"with torch.nn.attention.sdpa_kernel([{_SDPB}.{enum}, {_SDPB}.MATH]):", *["    " + ln for ln in lines]]


_TORCH_CONSTS = (torch.dtype, torch.memory_format)


def _op_call(target: Any, x: str, args: tuple, kwargs: dict) -> str:
    """A call of an aten op overload on ``x`` with constant further arguments, as source."""
    ns, packet = getattr(target, "namespace", None), getattr(getattr(target, "overloadpacket", None), "__name__", None)
    if ns is None or packet is None:
        raise AdapterError(f"cannot write a call to {target!r}")
    consts = [*args, *kwargs.values()]
    if not all(isinstance(a, (int, float, bool, list, tuple, *_TORCH_CONSTS)) or a is None for a in consts):
        raise AdapterError(f"cannot write the arguments of {target!r}")
    text = [repr(a) if not isinstance(a, _TORCH_CONSTS) else str(a) for a in args]
    text += [f"{k}={v!r}" if not isinstance(v, _TORCH_CONSTS) else f"{k}={v}" for k, v in kwargs.items()]
    return f"torch.ops.{ns}.{packet}.{target._overloadname}({', '.join([x, *text])})"


def varlen_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    """One SDPA per segment of the packed dim between consecutive offsets (read on the host, as the
    reference does), each output through the reference's view ops, concatenated."""
    if impl is not Impl.library:
        raise AdapterError("varlen attention: only the per-segment library implementation")
    p = site.params
    q, k, v, cu = (c.name(site.inputs[r]) for r in ("q", "k", "v", "cu"))
    d = int(p["seq_dim"])
    seg = ["_o = " + _sdpa_call(site, c, "_q", "_k", "_v", None)]
    for target, args, kwargs in p.get("chain", []):
        seg.append("_o = " + _op_call(target, "_o", tuple(args), dict(kwargs)))
    return [
        f"_b = [int(_x) for _x in {cu}.reshape(-1).tolist()]",
        "_segs = []",
        "for _i in range(len(_b) - 1):",
        "    if _b[_i + 1] <= _b[_i]:",
        "        continue",
        f"    _q = {q}.narrow({d}, _b[_i], _b[_i + 1] - _b[_i])",
        f"    _k = {k}.narrow({d}, _b[_i], _b[_i + 1] - _b[_i])",
        f"    _v = {v}.narrow({d}, _b[_i], _b[_i + 1] - _b[_i])",
        *["    " + ln for ln in _backend_wrap(c, seg)],
        "    _segs.append(_o)",
        f"{out} = torch.cat(_segs, {int(p['cat_dim'])})",
    ]


def attention_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    p = site.params
    if p.get("style") == "varlen":
        return varlen_lines(site, impl, c, out, extra)
    q, k, v = (c.name(site.inputs[r]) for r in ("q", "k", "v"))
    low = (
        c.knobs.get("attn_precision") == "low" and p.get("q_src_dtype") in LOW_DTYPES and p.get("in_dtype") == "float32"
    )
    cast = _dt(p["q_src_dtype"]) if low else None
    if cast:
        qq, kk, vv = (f"{t}.to({cast})" for t in (q, k, v))
    elif p.get("gqa"):  # the un-repeated k / v are read before the reference's cast: match q's dtype
        qq, kk, vv = q, f"{k}.to({q}.dtype)", f"{v}.to({q}.dtype)"
    else:
        qq, kk, vv = q, k, v
    call = _sdpa_call(site, c, qq, kk, vv, cast)
    if cast:
        call = f"{call}.to(torch.float32)"
    backend = c.knobs.get("sdpa_backend", "auto")
    if backend == "auto":
        lib = [f"{out} = {call}"]
    else:
        enum = _BACKEND_ENUM[backend]
        lib = [
            f"with torch.nn.attention.sdpa_kernel([{_SDPB}.{enum}, {_SDPB}.MATH]):",
            f"    {out} = {call}",
        ]
    if impl is Impl.library:
        return lib
    if impl is not Impl.family or c.part is None:
        raise AdapterError("attention: no implementation")
    scale = _scale_expr(site, c)
    scale_ok = "True" if scale is None else f"abs(({scale}) * math.sqrt({q}.shape[-1]) - 1.0) < 1e-6"
    dt = f"{qq}.dtype == torch.bfloat16" if cast else f"{q}.dtype == torch.bfloat16"
    cond = (f"{q}.dim() == 4 and {dt} and {q}.shape[2] == {k}.shape[2] and {q}.shape[1] % {k}.shape[1] == 0 "
            f"and {q}.shape[-1] in (16, 32, 64, 128) and {scale_ok}")  # fmt: skip
    bias = ""
    mask = site.inputs.get("mask")
    if mask is not None:
        # a key-padding mask (one value per batch row and key, broadcast over heads and queries) as the kernel's
        # additive key bias; any other mask shape runs the library call
        m = c.name(mask)
        cond += (f" and {m}.dim() == 4 and {m}.shape[1] == 1 and {m}.shape[2] == 1 and {m}.shape[0] in (1, "
                 f"{q}.shape[0]) and {m}.shape[3] == {k}.shape[2]")  # fmt: skip
        m2 = f"{m}.reshape({m}.shape[0], {m}.shape[3])"
        if p["mask"] == "drop":
            bias = f", key_bias=torch.where({m2}, float('-inf'), 0.0)"
        elif p["mask"] == "keep":
            bias = f", key_bias=torch.where({m2}, 0.0, float('-inf'))"
        else:
            ms = _mask_scale_expr(site, c)
            bias = f", key_bias={m2}.to(torch.float32)" + (f" * ({ms})" if ms is not None else "")
    fam = f"{c.part}run({qq}, {kk}, {vv}, {int(bool(p['causal']))}{bias})"
    if cast:
        fam = f"{fam}.to(torch.float32)"
    return [f"if {cond}:", f"    {out} = {fam}", "else:", *["    " + ln for ln in lib]]


def rope_on_family(p: dict[str, Any]) -> bool:
    """The RoPE kernels serve this site: halves rotated (cos / sin equal on both halves, or any full-width
    cos / sin through ``patch_rope_full_cos``), or pairs (interleaved) with half-width cos / sin or
    full-width ones holding each value twice in a row."""
    if p.get("style") == "rotate_half":  # cos / sin of both halves read apart where they may differ
        return True
    if p.get("style") == "split_halves":
        return bool(p.get("dup_halves"))
    if p.get("style") == "interleaved_complex":  # complex freqs: one (cos, sin) pair per complex entry
        return True
    return p.get("style") == "interleaved" and bool(p.get("half_width") or p.get("dup_pairs"))


def rope_full_cos(p: dict[str, Any]) -> bool:
    """The site rotates halves with full-width cos / sin not provably equal on both halves."""
    return p.get("style") == "rotate_half" and not p.get("dup_halves") and not p.get("half_width")


def rope_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    if impl is not Impl.family or c.part is None or c.fallback is None:
        raise AdapterError("rope: only the family implementation (the graph's ops otherwise)")
    x = c.name(site.inputs["x"])
    if site.params.get("style") == "interleaved_complex":  # x * freqs as complex numbers: cos / sin = its parts
        f = c.name(site.inputs["freqs"])
        cos, sin = f"{f}.real", f"{f}.imag"
    else:
        cos, sin = (c.name(site.inputs[r]) for r in ("cos", "sin"))
    half = bool(site.params.get("half_width"))
    if site.params.get("style") == "interleaved" and not half:  # each pair's value, once
        cos, sin, half = f"{cos}[..., 0::2]", f"{sin}[..., 0::2]", True
    keep = rope_full_cos(site.params)
    fam = f"{c.part}run(_l[0], _l[0][:, :0], _l[1], _l[2])[0].view({x}.shape)"
    return [
        f"_l = _kernelarc_rope_layout({x}, {cos}, {sin}, {half}, {keep})",
        "if _l is not None:",
        f"    {out} = {_out(site, fam)}",
        "else:",
        *["    " + ln for ln in c.fallback()],
    ]


def _generated_lines(c: Ctx, call: str, names: list[str]) -> list[str]:
    """A generated kernel's call (``run`` returns its outputs, or None where it does not serve the inputs) and the
    site's own ops as the fallback."""
    return [
        f"_f = {c.part}{call}",
        "if _f is not None:",
        f"    {', '.join(names)}, = _f",
        "else:",
        *["    " + ln for ln in c.fallback()],
    ]


def fused_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    """A fused region (``kernelarc.graph.fusion``): its generated kernel, or its own ops for inputs the kernel
    does not serve (rows wider than it holds, other shapes than traced)."""
    if impl is not Impl.family or c.part is None or c.fallback is None:
        raise AdapterError("fused region: only the generated kernel (the graph's ops otherwise)")
    region = site.params["_region"]
    ins = ", ".join(c.name(a) for a in region.inputs)
    names = [out if n is site.output else extra[f"out{i}"] for i, n in enumerate(region.outputs)]
    return _generated_lines(c, f"run({ins})", names)


def dwconv_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    """A depthwise conv1d site (``kernelarc.graph.dwconv``): its generated kernel, or its own ops for inputs the
    kernel does not serve (another channel count, filter or dtype than traced)."""
    if impl is not Impl.family or c.part is None or c.fallback is None:
        raise AdapterError("dwconv: only the generated kernel (the graph's ops otherwise)")
    plan = site.params["_plan"]
    b = site.inputs.get("bias")
    args = [c.name(site.inputs["x"]), c.name(site.inputs["weight"]), c.name(b) if b is not None else "None"]
    ins = ", ".join(args + [c.name(e) for e, _ in plan.extras])
    names = [out if n is site.output else extra[f"out{i}"] for i, n in enumerate(plan.outputs)]
    return _generated_lines(c, f"run({ins})", names)


def scatter_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    """The scatter-add family where the operands are what it takes; the site's own ops otherwise."""
    if impl is not Impl.family or c.part is None or c.fallback is None:
        raise AdapterError("scatter_add: only the family implementation (the graph's own ops otherwise)")
    p = site.params
    idx, src = c.name(site.inputs["index"]), c.name(site.inputs["source"])
    if "base" in site.inputs:
        base = c.name(site.inputs["base"])
        rows = f"{base}.shape[0]"
    else:
        base = "None"
        rows = f"{c.name(site.inputs['like'])}.shape[0]" if p.get("like_rows") else c.name(site.inputs["rows"])
    cond = (f"{idx}.dim() == 1 and {idx}.dtype in (torch.int64, torch.int32) and {src}.dim() >= 1"
            f" and {src}.shape[0] == {idx}.shape[0] and {src}.dtype == torch.{p['dtype']}")  # fmt: skip
    if base != "None":
        cond += f" and {base}.dtype == torch.{p['dtype']} and {base}.shape[1:] == {src}.shape[1:]"
    rows_idx = f"torch.where({idx} < 0, {idx} + {rows}, {idx})" if p.get("wrap") else idx
    return [
        f"if {cond}:",
        f"    {out} = {c.part}run({base}, {rows_idx}, {src}, {rows}, torch.{p['out_dtype']})",
        "else:",
        *["    " + ln for ln in c.fallback()],
    ]


def group_norm_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    """The GroupNorm family where the input is contiguous with whole groups of channels and the affine is per channel
    (the residual of the input's shape and dtype); the site's own ops otherwise."""
    if impl is not Impl.family or c.part is None or c.fallback is None:
        raise AdapterError("group_norm: only the family implementation (the graph's own ops otherwise)")
    p = site.params
    x, g = c.name(site.inputs["x"]), p["groups"]
    w = c.name(site.inputs["weight"]) if site.inputs.get("weight") is not None else "None"
    b = c.name(site.inputs["bias"]) if site.inputs.get("bias") is not None else "None"
    r = c.name(site.inputs["residual"]) if p.get("residual") else "None"
    cond = f"{x}.dim() >= 3 and {x}.is_contiguous() and {x}.shape[1] % {g} == 0 and {x}.numel() > 0"
    for t in (w, b):
        if t != "None":
            cond += f" and {t}.shape == ({x}.shape[1],) and {t}.is_contiguous()"
    if r != "None":
        cond += f" and {r}.shape == {x}.shape and {r}.dtype == {x}.dtype and {r}.is_contiguous()"
    return [
        f"if {cond}:",
        f"    {out} = {c.part}run({x}, {w}, {b}, {g}, {float(p['eps'])!r}, {p['act']!r}, {r})",
        "else:",
        *["    " + ln for ln in c.fallback()],
    ]


def counting_sort_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    """The counting sort family for 1-D int32 / int64 keys (``kernelarc.graph.sorting``); the site's own ops
    otherwise (the family declines other inputs too: the graph's ops then run)."""
    if impl is not Impl.family or c.part is None or c.fallback is None:
        raise AdapterError("counting_sort: only the family implementation (the graph's own ops otherwise)")
    from kernelarc.graph.sorting import ROLES, describe_roles

    p = site.params
    keys = c.name(site.inputs["keys"])
    names = {role: out if node is site.output else extra[role] for role, node in describe_roles(site)}
    asked = ", ".join(repr(bool(p[r])) for r in ROLES)
    unpack = ", ".join(names.get(r, "_") for r in ROLES)
    # the keys' bound: a constant, or the size of the dimension they index (topk's input) read when it runs
    of = site.inputs.get("bins_of")
    bins = f"{c.name(of)}.shape[{int(p['bins_dim'])}]" if of is not None else str(int(p["bins"]))
    return [
        f"_f = {c.part}run({keys}, {bins}, {asked}) if {keys}.dim() == 1 else None",
        "if _f is not None:",
        f"    {unpack} = _f",
        "else:",
        *["    " + ln for ln in c.fallback()],
    ]


LINES: dict[Kind, Callable[[Site, Impl, Ctx, str, dict[str, str]], list[str]]] = {
    Kind.rmsnorm: rmsnorm_lines,
    Kind.add_rmsnorm: rmsnorm_lines,
    Kind.layernorm: layernorm_lines,
    Kind.softmax: softmax_lines,
    Kind.glu: glu_lines,
    Kind.gemm: gemm_lines,
    Kind.fp8_gemm: fp8_gemm_lines,
    Kind.attention: attention_lines,
    Kind.rope: rope_lines,
    Kind.fused: fused_lines,
    Kind.dwconv: dwconv_lines,
    Kind.scatter_add: scatter_lines,
    Kind.group_norm: group_norm_lines,
    Kind.counting_sort: counting_sort_lines,
}


def site_lines(site: Site, impl: Impl, c: Ctx, out: str, extra: dict[str, str]) -> list[str]:
    fn = LINES.get(site.kind)
    if fn is None:
        raise AdapterError(f"no adapter for {site.kind.value}")
    return fn(site, impl, c, out, extra)
