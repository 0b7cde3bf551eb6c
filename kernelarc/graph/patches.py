"""Source rewrites of rendered family modules for the sites a family's own interface does not take as
is: another eps (RMSNorm), another gate activation or two gate / up tensors (SwiGLU), interleaved pairs
or full-width cos / sin (RoPE). Each rewrite must match the rendered text exactly as expected, so a
family whose source drifts is refused with ``AdapterError`` (the site keeps the graph's ops), never
patched halfway; tests render every knob value through each rewrite.
"""

from __future__ import annotations

import math
import re


class AdapterError(ValueError):
    """The site cannot take this implementation (the message says which precondition fails)."""


# the gate activation in the family's Triton (the SwiGLU kernel's ``y = (...) * u`` with g the gate, in
# fp32) and in torch; the tanh GELU as g * sigmoid(2 k (g + 0.044715 g^3)), the same function
GLU_TRITON = {
    "silu": None,  # the family's own (its ``silu`` knob)
    "gelu_tanh": "g / (1.0 + tl.exp(-1.5957691216057308 * (g + 0.044715 * g * g * g)))",
    "gelu_none": "0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))",
    "relu": "tl.maximum(g, 0.0)",
    "sigmoid": "1.0 / (1.0 + tl.exp(-g))",
}


def patch_glu_act(source: str, act: str) -> str:
    """A rendered SwiGLU family module computing ``act(gate) * up`` instead of silu."""
    expr = GLU_TRITON.get(act, "")
    if act == "silu":
        return source
    if not expr:
        raise AdapterError(f"no Triton form of the gate activation {act!r}")
    pat = re.compile(r"^(\s*)y = \((.+)\) \* u$", re.M)
    if not pat.search(source):
        raise AdapterError("rendered SwiGLU kernel has no 'y = (silu) * u' line to replace")
    return pat.sub(lambda m: f"{m.group(1)}y = ({expr}) * u", source)


def patch_glu_round_act(source: str, dtype: str) -> str:
    """A rendered SwiGLU family module that rounds ``act(gate)`` to ``dtype`` (bfloat16 / float16) before
    the product, as a reference of separate low-precision ops does (the family's fp32 product is then
    rounded once more at the store, as the reference's product is)."""
    tl_dtype = {"bfloat16": "tl.bfloat16", "float16": "tl.float16"}.get(dtype)
    if tl_dtype is None:
        raise AdapterError(f"no rounding of the gate activation to {dtype!r}")
    pat = re.compile(r"^(\s*)y = \((.+)\) \* u$", re.M)
    source, n = pat.subn(lambda m: f"{m.group(1)}y = _cast_out({m.group(2)}, {tl_dtype}).to(tl.float32) * u", source)
    if n != 1:
        raise AdapterError(f"rendered SwiGLU kernel: 'y = (act) * u' matched {n} times (expected once)")
    return source


# A rendered SwiGLU module reads gate and up as the two halves of one [M, 2N] row; a gate and an up
# that are separate tensors (two projections) take the same kernel with a second base pointer. Each
# rewrite must match exactly once, so a family whose source drifts is refused (AdapterError), never
# patched halfway.
_PAIR_REWRITES: tuple[tuple[str, str], ...] = (
    (r"def (_swiglu_\w+_kernel)\(X, Y, M, N, stride_x, stride_y,",
     r"def \1(X, U, Y, M, N, stride_x, stride_u, stride_y,"),
    (r"^(\s*)xrow = X \+ rows\[:, None\] \* stride_x$", r"\g<0>\n\1urow = U + rows[:, None] * stride_u"),
    (r"tl\.load\(xrow \+ N \+ cols", "tl.load(urow + cols"),
    (r"(_swiglu_\w+_kernel)\[grid\]\(x, y, M, N, x\.stride\(0\), y\.stride\(0\),",
     r"\1[grid](x, u, y, M, N, x.stride(0), u.stride(0), y.stride(0),"),
    (r"def run\(x\):\n    assert x\.dim\(\) == 2 and x\.shape\[1\] % 2 == 0\n(    if x\.stride\(-1\) != 1:\n"
     r"        x = x\.contiguous\(\)\n)    M = x\.shape\[0\]\n    N = x\.shape\[1\] // 2\n",
     "def run(x, u):\n    # gate x and up u: two [M, N] tensors (the packed [M, 2N] input's halves, apart)\n"
     "    assert x.dim() == 2 and u.shape == x.shape and u.dtype == x.dtype\n\\1"
     "    if u.stride(-1) != 1:\n        u = u.contiguous()\n    M = x.shape[0]\n    N = x.shape[1]\n"),
)  # fmt: skip


def patch_glu_pair(source: str) -> str:
    """A rendered SwiGLU family module whose ``run(gate, up)`` reads two [M, N] tensors."""
    for pat, rep in _PAIR_REWRITES:
        source, n = re.subn(pat, rep, source, flags=re.M)
        if n != 1:
            raise AdapterError(f"rendered SwiGLU kernel: {pat!r} matched {n} times (expected once)")
    return source


def patch_rope_interleaved(source: str) -> str:
    """A rendered RoPE family module rotating interleaved pairs (x[2i], x[2i + 1]) instead of halves
    (x[i], x[i + D/2]): its split kernels index 2 * d and d + 1 (the join kernels are left unused)."""
    blocks = list(re.finditer(r"@triton\.jit\ndef _rope_\w+_split_kernel\(.*?(?=\n\n\n|\Z)", source, re.S))
    if not blocks:
        raise AdapterError("rendered RoPE module has no split kernel to rotate pairs with")
    out, pos = [], 0
    for m in blocks:
        body = m.group(0)
        n_off, n_half = body.count("+ d[None, None, :]"), body.count("off + HALF")
        if n_off == 0 or n_off != n_half:  # one offset per load / store pair
            raise AdapterError(f"rendered RoPE split kernel: {n_off} offsets, {n_half} half-offset accesses")
        body = body.replace("+ d[None, None, :]", "+ 2 * d[None, None, :]").replace("off + HALF", "off + 1")
        out += [source[pos : m.start()], body]
        pos = m.end()
    source = "".join([*out, source[pos:]])
    source, _ = re.subn(r"kernel = (_rope_\w+)_join_kernel if bd == HALF else \1_split_kernel",
                        r"kernel = \1_split_kernel", source)  # fmt: skip
    if "_join_kernel if" in source or "+ HALF" in source:
        raise AdapterError("rendered RoPE module still rotates halves somewhere")
    return source


def patch_rope_full_cos(source: str) -> str:
    """A rendered RoPE family module rotating halves with cos / sin [T, D] whose halves may differ
    (``x * cos + rotate_half(x) * sin`` with arbitrary cos / sin): the split kernels load each half's
    values (the first at d, the second at d + D/2), the join kernels are left unused."""
    source, n_load = re.subn(
        r"^(\s*)(c3|s3) = tl\.load\((COS|SIN) \+ t64\[:, None\] \* (sc_t|ss_t) \+ dc\[None, :\](.*)$",
        r"\g<0>\n\1\2b = tl.load(\3 + t64[:, None] * \4 + dc[None, :] + HALF\5",
        source,
        flags=re.M,
    )
    source, n_o2 = re.subn(r"o2 = x2 \* c3 \+ x1 \* s3$", "o2 = x2 * c3b + x1 * s3b", source, flags=re.M)
    splits = len(re.findall(r"def _rope_\w+_split_kernel\(", source))
    joins = len(re.findall(r"def _rope_\w+_join_kernel\(", source))
    # every split kernel loads cos and sin once (two loads, join kernels their own two) and rotates q/k
    if splits == 0 or n_load != 2 * (splits + joins) or n_o2 < splits:
        raise AdapterError(f"rendered RoPE module: {n_load} cos / sin loads, {n_o2} second-half rotations")
    source, _ = re.subn(r"kernel = (_rope_\w+)_join_kernel if bd == HALF else \1_split_kernel",
                        r"kernel = \1_split_kernel", source)  # fmt: skip
    old = "assert cos.shape == (T, HALF) and sin.shape == (T, HALF)"
    if source.count(old) != 1 or "_join_kernel if" in source:
        raise AdapterError("rendered RoPE module: no single cos / sin shape check, or a join kernel still picked")
    return source.replace(old, "assert cos.shape == (T, D) and sin.shape == (T, D)")


def patch_eps(source: str, eps: float, builtin_eps: str = "1e-06") -> str:
    """A rendered RMSNorm family module with its eps literal set to ``eps``.

    The norms families bake eps = 1e-6 (the built-in tasks' value) into the kernel text as
    ``+ 1e-06``; a problem with another eps gets the same kernel with its own constant.
    """
    if math.isclose(eps, float(builtin_eps), rel_tol=1e-9):
        return source
    needle = f"+ {builtin_eps}"
    if needle not in source:
        raise AdapterError(f"rendered RMSNorm kernel has no eps literal {needle!r} to replace")
    return source.replace(needle, f"+ {eps!r}")
