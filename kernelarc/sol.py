"""Speed of light: work counted from the reference, a fused roofline over a target's ceilings.

The model follows NVIDIA SOLAR's "fused" speed of light (NVlabs/SOLAR ``docs/SOL_GUIDE.md``),
which SOL-ExecBench uses for its leaderboard:

* **compute**: matmul-like work (mm, bmm, addmm, baddbmm, convolution, SDPA, scaled/int/
  grouped mm, mv, dot) is ``2 * MACs`` FLOPs on tensor cores; every other op is "other" work
  on the SIMT units, one FLOP per element of its iteration space (the output, or the input
  of a reduction), transcendental ops included at 1 (SOLAR gives exp/log/sin... the same
  single op as add). Pure data movement (views, casts, copies, cat, gather/index, factory
  ops) is free. Attention is counted as written: a reference that builds full scores and
  masks them, or calls SDPA with ``is_causal``, counts the full ``4*B*H*Sq*Sk*D`` (SOLAR
  expands SDPA into its two matmuls regardless of causality).
* **memory**: only the problem's inputs and outputs (weights are inputs here): unique bytes
  at each tensor's own dtype, each storage counted once; intermediates are free.
* **roofline**: one whole-graph ``max(compute, memory)``.

Tensor-core work is keyed by the *precision the data came in*: a reference that upcasts
bf16 inputs to fp32 before its matmul (to be exact) is still a bf16 problem, so a matmul
operand remembers the lowest floating precision it was derived from through casts, views,
copies and elementwise ops (fp8 < bf16/fp16 < fp32 < fp64; a matmul output starts afresh at
its own dtype). Mixed operands take the lower precision (a dequantised fp8 weight makes an
fp8 GEMM), like SOLAR's per-problem precision and its fp8/fp4 quantisation override.

Known differences from SOLAR's current ``perf_model.py`` (options of :func:`t_sol`):

* SOLAR's code disables the SIMT term for the speed of light (tensor-core cycles only),
  while its guide writes ``max(tc, simt)``; here the compute time is ``Σ tc/peak + Σ
  simt/simt_rate`` by default (``simt=False`` reproduces the leaderboard's tensor-core-only
  compute; it matters for attention, where softmax work adds ~10-20 % on a B200).
* The leaderboard setup ``leaderboard_b200.yaml`` prices fp32 MACs at the 16-bit
  tensor-core rate (``fp32_as: fp16``: the optimised fp32 baselines exceed any TF32 peak);
  :func:`t_sol` does the same by default (``fp32_as="float16"``), ``fp32_as="float32"``
  prices them at the TF32 rate.
"""

from __future__ import annotations

import math
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry as _TORCH_FLOP_REGISTRY

from kernelarc.hardware import GpuTarget, bandwidth, dtype_key, peak

aten = torch.ops.aten

# --------------------------------------------------------------------------- Work


@dataclass
class Work:
    """What a reference computes and moves.

    ``tc_flops``: tensor-core FLOPs (2 per MAC) by the precision the operands came in;
    ``simt_flops``: other FLOPs by compute dtype; ``flops``: their total (derived when not
    given); ``io_bytes``: unique input + output bytes. ``ops`` counts aten calls by name,
    ``output`` is what the function returned.
    """

    tc_flops: dict[str, float] = field(default_factory=dict)
    simt_flops: dict[str, float] = field(default_factory=dict)
    flops: float | None = None
    io_bytes: float = 0.0
    ops: dict[str, int] = field(default_factory=dict)
    output: Any = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.flops is None:
            self.flops = float(sum(self.tc_flops.values()) + sum(self.simt_flops.values()))

    @property
    def tc_total(self) -> float:
        return float(sum(self.tc_flops.values()))

    @property
    def simt_total(self) -> float:
        return float(sum(self.simt_flops.values()))


# --------------------------------------------------------------------------- io bytes


def io_bytes_of(*objs: Any) -> int:
    """Unique bytes of all tensors in ``objs`` (nested lists/tuples/dicts allowed).

    Each storage is counted once: the union of the byte ranges the tensors address in it
    (a view and its base count once; two halves of one buffer count their two halves).
    Python scalars and None count 0.
    """
    spans: dict[tuple[str, int], list[tuple[int, int]]] = defaultdict(list)
    total = 0
    for leaf in pytree.tree_leaves(list(objs)):
        if not isinstance(leaf, torch.Tensor) or leaf.numel() == 0:
            continue
        item = leaf.element_size()
        if leaf.is_sparse or leaf.layout != torch.strided:
            total += leaf.numel() * item
            continue
        start = leaf.storage_offset() * item
        extent = 1 + sum((s - 1) * abs(st) for s, st in zip(leaf.shape, leaf.stride(), strict=True))
        # A broadcast (stride-0) view addresses fewer bytes than its numel; the span covers them.
        storage = leaf.untyped_storage()
        # data_ptr is 0 on the meta device; _cdata (the StorageImpl) is shared by views there too.
        key = (str(leaf.device), storage.data_ptr() or storage._cdata)
        spans[key].append((start, start + extent * item))
    for ranges in spans.values():
        ranges.sort()
        cur_s, cur_e = ranges[0]
        for s, e in ranges[1:]:
            if s <= cur_e:
                cur_e = max(cur_e, e)
            else:
                total += cur_e - cur_s
                cur_s, cur_e = s, e
        total += cur_e - cur_s
    return int(total)


# --------------------------------------------------------------------------- op classes


def _names(*ops: str) -> frozenset[str]:
    return frozenset(ops)


# Free: views, casts, copies, layout changes, gathers, factories, scalar reads.
_FREE_OPS = _names(
    "_to_copy", "to", "copy", "copy_", "clone", "contiguous", "cat", "stack", "hstack", "vstack",
    "repeat", "repeat_interleave", "index_select", "index", "gather", "take", "embedding",
    "constant_pad_nd", "pad", "flip", "roll", "_unsafe_view", "reshape", "view", "_reshape_alias",
    "empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones", "ones_like", "full",
    "full_like", "new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided", "arange",
    "linspace", "logspace", "eye", "scalar_tensor", "lift_fresh", "lift_fresh_copy", "detach",
    "alias", "fill", "fill_", "zero_", "_local_scalar_dense", "slice_scatter", "select_scatter",
    "as_strided_scatter", "diagonal_scatter", "split_with_sizes_copy", "unbind_copy", "set_",
    "resize_", "masked_select", "nonzero", "tril_indices", "triu_indices", "unfold", "narrow_copy",
    "t_copy", "permute_copy", "transpose_copy", "view_copy", "expand_copy", "diag_embed",
    "pixel_shuffle", "pixel_unshuffle", "channel_shuffle", "_pin_memory", "unsqueeze_copy",
    "squeeze_copy", "select_copy", "slice_copy", "alias_copy", "detach_copy", "_unsafe_index",
    "im2col", "col2im", "split", "split_with_sizes", "unbind", "chunk", "tensor_split", "movedim",
    "_efficientzerotensor", "record_stream", "_assert_async", "_assert_scalar", "_print",
    "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type",
    "_conj", "conj", "_neg_view", "resolve_conj", "resolve_neg", "view_as_real", "view_as_complex",
)  # fmt: skip

# Ops that update a few positions of ``self``: work is the size of the values scattered.
_SCATTER_OPS = _names(
    "index_put", "index_put_", "_index_put_impl_", "scatter", "scatter_", "scatter_add", "scatter_add_",
    "scatter_reduce", "scatter_reduce_", "index_add", "index_add_", "index_copy", "index_copy_",
    "index_fill", "index_fill_", "masked_scatter", "masked_scatter_", "index_reduce", "index_reduce_",
    "_unsafe_index_put", "embedding_dense_backward",
)  # fmt: skip


def _bmm_like(a: torch.Tensor, b: torch.Tensor) -> int:
    return 2 * a.numel() * b.shape[-1] if a.dim() >= 1 and b.dim() >= 1 else 0


def _sdpa_fwd_flops(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_dim: int = -2) -> int:
    """Q@K^T and P@V, each 2*MACs; GQA broadcasts k/v heads to the query heads.

    ``seq_dim=-2``: the SDPA ops' [B, H, S, D]; ``seq_dim=-3``: flash/efficient [B, S, H, D].
    """
    E = q.shape[-1]
    L = q.shape[seq_dim]
    S = k.shape[seq_dim]
    Ev = v.shape[-1]
    bh = q.numel() // (L * E)
    return 2 * bh * L * S * E + 2 * bh * L * S * Ev


def _sdpa_scores(name: str, q: torch.Tensor, k: torch.Tensor) -> int:
    # _flash/_efficient_attention_forward take [B, S, H, D]; the SDPA ops take [B, H, S, D].
    k_len = k.shape[-3] if name in ("_flash_attention_forward", "_efficient_attention_forward") else k.shape[-2]
    return q.numel() // q.shape[-1] * k_len


def _f_sdpa(q, k, v, *args, **kwargs) -> int:
    return _sdpa_fwd_flops(q, k, v)


def _f_sdpa_bwd(grad_out, q, k, v, *args, **kwargs) -> int:
    return int(2.5 * _sdpa_fwd_flops(q, k, v))  # dV, dP, dQ, dK matmuls + recompute of S


def _f_flash(q, k, v, *args, **kwargs) -> int:
    return _sdpa_fwd_flops(q, k, v, seq_dim=-3)


def _f_flash_bwd(grad_out, q, k, v, *args, **kwargs) -> int:
    return int(2.5 * _sdpa_fwd_flops(q, k, v, seq_dim=-3))


def _f_int_mm(a, b, *args, **kwargs) -> int:
    return 2 * a.shape[0] * a.shape[1] * b.shape[1]


def _f_mv(a, v, *args, **kwargs) -> int:
    return 2 * a.numel()


def _f_addmv(bias, a, v, *args, **kwargs) -> int:
    return 2 * a.numel()


def _f_dot(a, b, *args, **kwargs) -> int:
    return 2 * a.numel()


def _f_addr(bias, a, b, *args, **kwargs) -> int:
    return 2 * a.numel() * b.numel()


def _f_grouped_mm(a, b, *args, **kwargs) -> int:
    # 2D x 3D (ragged M over groups): every row of a meets one group's [K, N];
    # 3D x 3D: a batched mm; 2D x 2D (ragged K): each output block sums over its K slice.
    if a.dim() == 2 and b.dim() == 3:
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 3 and b.dim() == 3:
        return 2 * a.numel() * b.shape[-1]
    if a.dim() == 2 and b.dim() == 2:  # groups split K: together they cover M x K x N once
        return 2 * a.shape[0] * a.shape[1] * b.shape[-1]
    if a.dim() == 3 and b.dim() == 2:
        return 2 * a.numel() * b.shape[-1]
    return _bmm_like(a, b)


def _f_scaled_grouped_mm(a, b, *args, **kwargs) -> int:
    return _f_grouped_mm(a, b)


# Own formulas first (attention ones support GQA on every torch version); torch's
# flop_counter registry for the rest (mm, addmm, bmm, baddbmm, convolution, _scaled_mm...).
_RAW_TC: dict[str, Callable[..., int]] = {
    "_scaled_dot_product_flash_attention_for_cpu": _f_sdpa,
    "_scaled_dot_product_fused_attention_overrideable": _f_sdpa,
    "_scaled_dot_product_flash_attention": _f_sdpa,
    "_scaled_dot_product_efficient_attention": _f_sdpa,
    "_scaled_dot_product_cudnn_attention": _f_sdpa,
    "_scaled_dot_product_flash_attention_for_cpu_backward": _f_sdpa_bwd,
    "_scaled_dot_product_fused_attention_overrideable_backward": _f_sdpa_bwd,
    "_scaled_dot_product_flash_attention_backward": _f_sdpa_bwd,
    "_scaled_dot_product_efficient_attention_backward": _f_sdpa_bwd,
    "_scaled_dot_product_cudnn_attention_backward": _f_sdpa_bwd,
    "_flash_attention_forward": _f_flash,
    "_efficient_attention_forward": _f_flash,
    "_flash_attention_backward": _f_flash_bwd,
    "_efficient_attention_backward": _f_flash_bwd,
    "_int_mm": _f_int_mm,
    "mv": _f_mv,
    "addmv": _f_addmv,
    "dot": _f_dot,
    "vdot": _f_dot,
    "addr": _f_addr,
    "_grouped_mm": _f_grouped_mm,
    "_scaled_grouped_mm": _f_scaled_grouped_mm,
}
_TORCH_TC: dict[str, Any] = {str(k.__name__): v for k, v in _TORCH_FLOP_REGISTRY.items() if hasattr(k, "__name__")}

# Fused attention ops also do softmax work on the SIMT units (scale + softmax per score).
_SDPA_NAMES = _names(
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_fused_attention_overrideable",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
)  # fmt: skip

_FLOAT_BITS = {
    "float8_e4m3fn": 8, "float8_e5m2": 8, "float8_e4m3fnuz": 8, "float8_e5m2fnuz": 8, "float8_e8m0fnu": 8,
    "float4_e2m1fn_x2": 4, "bfloat16": 16, "float16": 16, "float32": 32, "float64": 64,
}  # fmt: skip


def _dname(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _is_float_name(name: str) -> bool:
    return name in _FLOAT_BITS


class _WorkCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.tc: dict[str, float] = defaultdict(float)
        self.simt: dict[str, float] = defaultdict(float)
        self.ops: dict[str, int] = defaultdict(int)
        self._origin: dict[int, tuple[weakref.ref, str]] = {}

    # provenance ---------------------------------------------------------------------------
    def origin(self, t: torch.Tensor) -> str:
        rec = self._origin.get(id(t))
        if rec is not None and rec[0]() is t:
            return rec[1]
        return _dname(t)

    def _set_origin(self, t: torch.Tensor, name: str) -> None:
        try:
            ref = weakref.ref(t)
        except TypeError:  # pragma: no cover - every Tensor supports weak references
            return
        self._origin[id(t)] = (ref, name)

    def _lowest_origin(self, tensors: Sequence[torch.Tensor]) -> str | None:
        best, best_bits = None, 10**9
        for t in tensors:
            o = self.origin(t)
            bits = _FLOAT_BITS.get(o)
            if bits is not None and bits < best_bits:
                best, best_bits = o, bits
        return best

    # dispatch -----------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        try:
            self._account(func, args, kwargs, out)
        except Exception as e:  # counting must never break the reference
            warnings.warn(f"sol: could not count {func}: {e!r}", stacklevel=2)
        return out

    def _account(self, func, args, kwargs, out) -> None:
        name = func._overloadpacket.__name__
        self.ops[name] += 1
        ins = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        float_ins = [t for t in ins if _is_float_name(_dname(t))]

        tc_fn = _RAW_TC.get(name)
        torch_fn = _TORCH_TC.get(name) if tc_fn is None else None
        if tc_fn is not None or torch_fn is not None:
            n = tc_fn(*args, **kwargs) if tc_fn is not None else torch_fn(*args, **kwargs, out_val=out)
            operands = float_ins or [t for t in ins if t.dtype in (torch.int8, torch.uint8)]
            key = self._lowest_origin(operands) or (_dname(operands[0]) if operands else "float32")
            if key not in _FLOAT_BITS:
                key = "int8" if any(t.dtype in (torch.int8, torch.uint8) for t in operands) else key
            self.tc[dtype_key(key)] += float(n)
            if name in _SDPA_NAMES and len(ins) >= 2:
                self.simt["float32"] += 2.0 * _sdpa_scores(name, ins[0], ins[1])
            for t in outs:
                self._set_origin(t, _dname(t))
            return

        # provenance of non-matmul outputs: the lowest precision among float inputs
        low = self._lowest_origin(float_ins)
        for t in outs:
            own = _dname(t)
            if low is not None and _is_float_name(own) and _FLOAT_BITS[low] < _FLOAT_BITS[own]:
                self._set_origin(t, low)

        if name in _FREE_OPS or getattr(func, "is_view", False):
            return
        if name in _SCATTER_OPS:
            rest = [t for t in ins[1:] if _is_float_name(_dname(t))] or ins[1:]
            n = max((t.numel() for t in rest), default=0)
        else:
            n = max(max((t.numel() for t in ins), default=0), sum(t.numel() for t in outs))
        if n == 0:
            return
        key = None
        for t in outs:
            if _is_float_name(_dname(t)):
                key = _dname(t)
                break
        if key is None:
            key = max((_dname(t) for t in float_ins), key=lambda d: _FLOAT_BITS[d], default="float32")
        self.simt[dtype_key(key)] += float(n)


def count_work(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    io_bytes: float | None = None,
    kwargs: dict[str, Any] | None = None,
) -> Work:
    """Run ``fn(*inputs)`` once under a counting dispatch mode; return its :class:`Work`.

    The reference really runs (data-dependent shapes, routing and custom inputs are seen
    as they are); its return value is ``Work.output``. ``io_bytes`` defaults to the unique
    bytes of ``inputs`` and the output (:func:`io_bytes_of`); pass the task's own figure
    (``Task.io_bytes(i)``) to count by the definition's shapes instead.
    """
    counter = _WorkCounter()
    with counter:
        output = fn(*inputs, **(kwargs or {}))
    nbytes = float(io_bytes) if io_bytes is not None else float(io_bytes_of(list(inputs), output))
    return Work(
        tc_flops={k: v for k, v in counter.tc.items() if v},
        simt_flops={k: v for k, v in counter.simt.items() if v},
        io_bytes=nbytes,
        ops=dict(counter.ops),
        output=output,
    )


def task_work(task: Any, index: int, *, device: str = "cpu", seed: int = 0) -> Work:
    """:func:`count_work` of a task's reference on workload ``index``, with ``io_bytes`` from
    the definition (``task.io_bytes(index)``).

    ``device="meta"`` counts without computing (shapes only, instant even for the largest
    workloads): it needs random/scalar inputs and a reference without data-dependent
    shapes or values; otherwise use a real device.
    """
    from kernelarc.tasks.inputs import load_module, make_inputs, torch_dtype
    from kernelarc.tasks.loader import TaskError

    ref = load_module(task.definition.reference, f"reference_{task.name}").run
    if device == "meta":
        wl = task.workloads[index]
        inputs: list[Any] = []
        for name, spec in task.definition.inputs.items():
            desc = wl.inputs[name]
            if desc.type == "scalar":
                inputs.append(desc.value)
            elif desc.type == "random":
                inputs.append(torch.empty(task.shape(name, index) or (), dtype=torch_dtype(spec.dtype), device="meta"))
            else:
                raise TaskError(f"{task.name}: input {name} is {desc.type!r}; count it on a real device, not meta")
    else:
        inputs = make_inputs(task, index, seed, device)
    return count_work(ref, inputs, io_bytes=task.io_bytes(index))


# --------------------------------------------------------------------------- roofline


def sol_terms(
    work: Work,
    target: GpuTarget,
    *,
    fp32_as: str | None = "float16",
    simt: bool = True,
    overhead_s: float = 0.0,
) -> dict[str, Any]:
    """The roofline's parts in seconds: ``t_tc``, ``t_simt``, ``t_compute``, ``t_memory``,
    ``t_sol`` and ``bound`` ("compute" or "memory"); options as in :func:`t_sol`."""
    t_tc = 0.0
    for d, f in work.tc_flops.items():
        if not f:
            continue
        key = dtype_key(d)
        if key == "float32" and fp32_as:
            key = dtype_key(fp32_as)
        t_tc += f / peak(target, key, tensor_core=True)
    t_simt = 0.0
    if simt:
        for d, f in work.simt_flops.items():
            if f:
                t_simt += f / peak(target, d, tensor_core=False)
    t_compute = t_tc + t_simt
    t_mem = work.io_bytes / bandwidth(target) if work.io_bytes else 0.0
    bound = "compute" if t_compute >= t_mem and t_compute > 0 else "memory"
    return {
        "t_tc": t_tc,
        "t_simt": t_simt,
        "t_compute": t_compute,
        "t_memory": t_mem,
        "t_sol": max(t_compute, t_mem) + overhead_s,
        "bound": bound,
    }


def t_sol(
    work: Work,
    target: GpuTarget,
    *,
    fp32_as: str | None = "float16",
    simt: bool = True,
    overhead_s: float = 0.0,
) -> tuple[float, str]:
    """Speed-of-light seconds and the bound that sets it (``"compute"`` or ``"memory"``).

    ``max(Σ_d tc_flops[d] / peak(d) + Σ_d simt_flops[d] / simt(d), io_bytes / bandwidth)``
    with :func:`kernelarc.hardware.peak` / :func:`~kernelarc.hardware.bandwidth` (calibrated
    values preferred where the target has them). ``fp32_as``: the tensor-core rate for fp32
    MACs (default ``"float16"``, the leaderboard's policy; ``"float32"`` = TF32; None = as
    keyed). ``simt=False`` drops the SIMT term as SOLAR's perf model does. ``overhead_s`` is
    added to the roofline time: the published SOL-ExecBench ``sol_ms`` carry about 0.4 µs on
    top of SOLAR's roofline (``overhead_s=4e-7`` reproduces them). Ties count as
    compute-bound; zero work is ``(overhead_s, "memory")``.
    """
    terms = sol_terms(work, target, fp32_as=fp32_as, simt=simt, overhead_s=overhead_s)
    return terms["t_sol"], terms["bound"]


def sol_score(t_k: float, t_sol: float, t_b: float) -> float:
    """SOL-ExecBench's score ``1 / (1 + (t_k - t_sol) / (t_b - t_sol))``: 0.5 at the baseline,
    1.0 at the speed of light, towards 0 for slower kernels.

    Edge cases:

    * ``t_k < t_sol`` (a kernel measured faster than the bound: the model or the timing is
      off): ``t_k`` is clamped to ``t_sol`` and the score is 1.0.
    * ``t_b <= t_sol`` (the baseline is already at or below the bound, so the gap that the
      score divides by is empty): scored against the baseline alone, ``t_b / (t_b + t_k)``
      (the formula with ``t_sol = 0``): 0.5 at the baseline, above it when faster.
    * Non-finite or non-positive ``t_k``/``t_b``, or a negative ``t_sol``: ValueError.
    """
    for nm, v in (("t_k", t_k), ("t_b", t_b)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"sol_score: {nm} must be a positive finite time, got {v!r}")
    if not (math.isfinite(t_sol) and t_sol >= 0):
        raise ValueError(f"sol_score: t_sol must be a finite time >= 0, got {t_sol!r}")
    if t_b <= t_sol:
        return t_b / (t_b + t_k)
    t_k = max(t_k, t_sol)
    return 1.0 / (1.0 + (t_k - t_sol) / (t_b - t_sol))


__all__ = ["Work", "count_work", "io_bytes_of", "sol_score", "sol_terms", "t_sol", "task_work"]
