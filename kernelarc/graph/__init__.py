"""Problem recognition and composition over the reference's captured graph.

``capture`` traces a problem's reference ``run`` into an aten-level FX graph (pre-dispatch, so
composite ops such as ``linear``, ``matmul``, ``softmax``, ``rms_norm`` and
``scaled_dot_product_attention`` stay whole) on meta tensors built from the definition.
``patterns`` recognises, by structure rather than by names, the sub-graphs KernelArc's kernel
families and libraries solve (GEMM with epilogues, attention, RMSNorm / LayerNorm, softmax,
elementwise chains, reductions); ``gated`` the gated activations (SwiGLU, GeGLU, ...) by what the
gate computes; ``rotary`` RoPE in its rotate-half, split-halves and interleaved forms; ``varlen``
per-segment attention over host-read offsets (cu_seqlens); ``groupnorm`` GroupNorm (the op or written out) with
the SiLU and residual add after it; ``quant`` scaled fp8 GEMMs written as
dequantise-then-matmul; ``catalog.recognize`` runs them all. ``adapters`` map a site onto a family's or
library's interface, with ``patches`` rewriting a rendered family module where the site needs another
form of its kernel (eps, gate activation, two gate / up tensors, interleaved or full-width RoPE).
``compose`` emits a candidate source for the whole problem: the graph as plain ``torch.ops.aten``
calls with recognised sites replaced by family kernels or library calls, under graph-level knobs
(library backends, Inductor options, CUDA graphs, precision). ``recurrence`` takes the references capture
refuses for unrolling a per-step Python loop: traced at a few short loop lengths, cut into prefix, identical
per-step blocks and suffix, and emitted as one Triton kernel that walks the steps with the carried state in
registers. ``moe`` takes a mixture-of-experts layer written as a Python loop over experts (data-dependent
sizes: capture refuses it, or holds it unrolled): recorded under a dispatch recorder at two small shapes,
cut into prefix, one repeated per-expert block and suffix, and written once for all experts with grouped
GEMMs (KernelArc's Triton kernel or ``torch._grouped_mm``).

This package imports nothing from ``kernelarc.families``: the family glue lives in
``kernelarc.families.composed``, which hands rendered kernel sources in.
"""

from kernelarc.graph.capture import Capture, CaptureError, capture_task

__all__ = ["Capture", "CaptureError", "capture_task"]
