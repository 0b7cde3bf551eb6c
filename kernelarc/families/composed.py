"""Families for problems without a hand-written family: the reference graph with recognised
sites served by KernelArc's kernels and libraries (``kernelarc.graph``).

For a problem (any SOL-ExecBench folder) ``composed_families(task)`` captures the reference,
recognises its sites (RMSNorm, fused add + RMSNorm, GEMM with epilogues, attention incl. varlen,
softmax, SwiGLU / GeGLU, RoPE, LayerNorm, GroupNorm (+ SiLU, + residual), ...) and offers:

* ``composed.<task>.library``: every site as the graph wrote it or as one fused library call
  (``F.rms_norm``, ``addmm`` / ``_addmm_activation`` cuBLASLt epilogues, SDPA under a chosen
  backend incl. cuDNN, ``F.layer_norm``, ``softmax``), with graph-level knobs: the rest eager or
  under Inductor (max-autotune, coordinate-descent tuning, epilogue fusion), CUDA-graph replay,
  TF32 for fp32 matmuls, low-precision attention inputs (the guard's tolerance decides);
* ``composed.<task>.<family>`` for every built-in kernel family that can serve a site kind
  present (``rmsnorm.rowblock`` for an RMSNorm, ``matmul.tiled`` for a GEMM, ...): that
  family's knobs, under the same names (so the search ports points between it and the built-in
  task's family), plus the graph-level knobs; every site of that kind runs the family kernel.

* ``composed.<task>.recurrence`` where capture refuses the reference for unrolling a per-step Python loop
  (``GraphTooLarge``) and that loop is a pointwise recurrence (``kernelarc.graph.recurrence``): one Triton
  kernel walking the steps with the carried state in registers (knobs: lanes per program, warps, unrolling,
  prefetch, division / sqrt precision); it is then the problem's only composed family.
* ``composed.<task>.moe`` where the reference is a loop over experts (``kernelarc.graph.moe``): the loop written
  once for all experts, the experts' GEMMs grouped (knob: ``torch._grouped_mm``, KernelArc's Triton grouped GEMM
  and its tiles, or one mm per routed expert). Where capture refuses the reference (data-dependent sizes) it is the
  problem's only composed family; where capture holds the loop unrolled it is offered beside the others, first.

No family here is static (``FAMILIES`` is empty): they depend on the problem.

``start_points`` orders the first candidates worth measuring on a tiny budget: the KernelArc kernel
families of the recognised kinds (rest of the graph compiled where it has compute left), the library
family, then the other variants, instead of re-runs of the reference under other compile settings.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from kernelarc.families.base import Family, Knob
from kernelarc.families.matmul_f32 import FAMILY_NAME as F32_NAME
from kernelarc.graph.adapters import (
    FAMILY_TASK,
    LIBRARY_KINDS,
    SDPA_BACKENDS,
    AdapterError,
    Impl,
    family_ok,
    patch_eps,
    patch_glu_act,
    patch_glu_pair,
    patch_glu_round_act,
    patch_rope_full_cos,
    patch_rope_interleaved,
    rope_full_cos,
)
from kernelarc.graph.capture import (
    Capture,
    CaptureError,
    GraphTooLarge,
    baked_values,
    capture_task,
    example_inputs,
    node_dtype,
    op,
)
from kernelarc.graph.catalog import recognize
from kernelarc.graph.compose import CasePlan, CompositionError, GraphKnobs, SitePlan, check_case, emit_module
from kernelarc.graph.dwconv import FAMILY as DWCONV_NAME
from kernelarc.graph.dwconv import render_dwconv
from kernelarc.graph.fusion import FAMILY as FUSED_NAME
from kernelarc.graph.fusion import render_fused
from kernelarc.graph.moe import GEMMS as MOE_GEMMS
from kernelarc.graph.moe import TILE_KNOBS as MOE_TILES
from kernelarc.graph.moe import TILE_START as MOE_TILE_START
from kernelarc.graph.moe import MoE, MoEError, recognise_moe
from kernelarc.graph.patterns import Kind, Site
from kernelarc.graph.recurrence import KNOB_DEFAULTS as RECURRENCE_DEFAULTS
from kernelarc.graph.recurrence import Recurrence, RecurrenceError, recognise_recurrence, render_recurrence

log = logging.getLogger(__name__)

FAMILIES: list[Family] = []

SUBSTITUTABLE = set(FAMILY_TASK) | LIBRARY_KINDS | {Kind.fused, Kind.dwconv}
# kernel families serving a kind besides its built-in task's: float32 GEMM sites on the split-precision family
EXTRA_TASKS: dict[Kind, tuple[str, ...]] = {Kind.gemm: ("matmul_f32",)}


def kind_tasks(kind: Kind) -> tuple[str, ...]:
    """The tasks whose kernel families can serve ``kind``'s sites."""
    return (FAMILY_TASK[kind], *EXTRA_TASKS.get(kind, ()))


def kind_of_task(task: str) -> Kind | None:
    return next((k for k in FAMILY_TASK if task in kind_tasks(k)), None)


def takes(fam: Family, site: Site) -> bool:
    """Whether kernel family ``fam`` takes ``site``'s operand dtype (a family without a dtype list takes any)."""
    dt = site.params.get("dtype")
    return not fam.dtypes or dt is None or str(dt) in fam.dtypes


def _per_site(knobs: Mapping[str, Any]) -> str:
    raise TypeError("generated kernels (fused regions, depthwise convolutions) are rendered per site, in a composition")


# The kernel of fused regions (kernelarc.graph.fusion): generated per region, so it has no built-in task; its
# knobs are the generated kernels' (the same for every region of a candidate).
FUSED_KERNEL = Family(
    name=FUSED_NAME,
    task="",
    description="elementwise ops with their row and column reductions as one generated Triton kernel per region "
    "(persistent programs over blocks of rows, a row held in registers)",
    knobs=(
        Knob("TILE", (1024, 2048, 4096, 8192, 16384), "tiling", "elements per block of rows (rows = TILE / row width)"),
        Knob(
            "NUM_WARPS",
            ("auto", 4, 8, 2, 16, 1),
            "scheduling",
            "warps per program ('auto': 4 below 2048 elements per row block, 8 below 8192, else 16)",
        ),
        Knob(
            "WAVES",
            (8, 4, 16, 2, 32),
            "scheduling",
            "regions with column or full sums: persistent programs per SM, one partial sum each",
        ),
    ),
    start={"TILE": 4096, "NUM_WARPS": "auto", "WAVES": 8},
    render=_per_site,
    language="triton",
)

# The kernel of depthwise conv1d sites (kernelarc.graph.dwconv): generated per site (its slices and pointwise ops).
DWCONV_KERNEL = Family(
    name=DWCONV_NAME,
    task="",
    description="a depthwise conv1d with its time window, channel slices and the pointwise ops over them as one "
    "generated Triton kernel per site (a tile of channel rows by time steps; K shifted loads per slice)",
    knobs=(
        Knob("BLOCK_R", (4, 8, 2, 16, 1), "tiling", "channel rows per program"),
        Knob("BLOCK_L", (512, 1024, 256, 2048, 128), "tiling", "time steps per program"),
        Knob("NUM_WARPS", (4, 8, 2), "scheduling", "warps per program"),
    ),
    start={"BLOCK_R": 4, "BLOCK_L": 512, "NUM_WARPS": 4},
    render=_per_site,
    # at most 32 values of a tile per thread: each slice's sum and each outside tensor holds one such tile
    valid=lambda k: k["BLOCK_R"] * k["BLOCK_L"] <= 32 * 32 * k["NUM_WARPS"],
    language="triton",
)
# kernels generated per site, by the kind they serve
GENERATED = {Kind.fused: FUSED_KERNEL, Kind.dwconv: DWCONV_KERNEL}
GENERATED_KIND = {f.name: k for k, f in GENERATED.items()}


def _render_generated(site: Site, knobs: Mapping[str, Any], doc: str) -> str:
    """The generated kernel module of a fused region or a depthwise convolution site."""
    if site.kind is Kind.fused:
        return render_fused(site.params["_region"], dict(knobs), doc)
    return render_dwconv(site.params["_plan"], dict(knobs), doc)


@dataclass
class Recognition:
    """What was recognised in one problem: per graph case, its sites and which implementations fit."""

    task: str
    capture: Capture | None
    error: str | None = None
    sites: list[list[Site]] = field(default_factory=list)  # per case
    impls: dict[int, set[Impl]] = field(default_factory=dict)  # id(site) -> implementations that emit
    # a reference whose trace unrolls a per-step Python loop (capture's GraphTooLarge) and, where that loop
    # is a pointwise recurrence, its kernel plan (kernelarc.graph.recurrence)
    too_large: bool = False
    recurrence: Recurrence | None = None
    # a reference capture refuses for its data-dependent loop over experts, written for all experts at once
    # (kernelarc.graph.moe)
    moe: MoE | None = None

    def kinds(self) -> list[Kind]:
        seen: list[Kind] = []
        for case in self.sites:
            for s in case:
                if s.kind not in seen:
                    seen.append(s.kind)
        return seen

    def serves(self, site: Site, kind: Kind, impl: Impl) -> bool:
        """``site`` is of ``kind`` and ``impl`` can take it."""
        return site.kind is kind and impl in self.impls.get(id(site), ())

    def substitutable(self, kind: Kind, impl: Impl) -> list[Site]:
        return [s for case in self.sites for s in case if self.serves(s, kind, impl)]


_CACHE: dict[tuple, Recognition] = {}


def _key(task) -> tuple:
    h = hashlib.sha256(task.definition.model_dump_json().encode())
    for wl in task.workloads:
        h.update(wl.model_dump_json().encode())
    return (task.name, str(task.path), h.hexdigest())


def recognise(task) -> Recognition:
    """Capture and recognise ``task`` (cached per task and reference)."""
    key = _key(task)
    if key in _CACHE:
        return _CACHE[key]
    try:
        cap = capture_task(task)
    except CaptureError as e:
        rec = Recognition(task.name, None, error=str(e), too_large=isinstance(e, GraphTooLarge))
        if rec.too_large:
            _recurrence(task, rec)
        else:
            _moe(task, rec)
        _CACHE[key] = rec
        return rec
    rec = Recognition(task.name, cap)
    probe = {"sdpa_backend": "auto", "attn_precision": "reference"}
    for case in cap.cases:
        sites = recognize(case.gm)
        rec.sites.append(sites)
        for s in sites:
            if s.kind not in SUBSTITUTABLE:
                continue
            ok: set[Impl] = set()
            for impl in (Impl.library, Impl.family):
                if impl is Impl.family and family_ok(s) is not None:
                    continue
                try:
                    check_case(CasePlan(case, [SitePlan(s, impl, "_kx_" if impl is Impl.family else None)]), probe)
                except (CompositionError, AdapterError) as e:
                    log.debug("%s: %s site not emitted as %s: %s", task.name, s.kind.value, impl.value, e)
                    continue
                ok.add(impl)
            if ok:
                rec.impls[id(s)] = ok
    _drop_unsafe_baked(rec)
    if any(_unrolled_experts(case.gm) for case in cap.cases):
        _moe(task, rec)  # a loop over experts with no branch on their token counts captures, unrolled
    _CACHE[key] = rec
    return rec


def _unrolled_experts(gm: torch.fx.GraphModule) -> bool:
    """Whether a captured graph runs ``nonzero`` (or one-argument ``where``, as pre-dispatch tracing keeps it) more
    than once: a loop over experts unrolled."""
    aten = torch.ops.aten
    hits = [n for n in gm.graph.nodes if n.target is aten.nonzero.default or
            (n.target is aten.where.default and len(n.args) == 1)]  # fmt: skip
    return len(hits) >= 2


def _recurrence(task, rec: Recognition) -> None:
    """A reference refused for unrolling a per-step loop: recognise the loop as a recurrence kernel."""
    try:
        rec.recurrence = recognise_recurrence(task)
    except RecurrenceError as e:
        rec.error = f"{rec.error}; not a recurrence KernelArc emits: {e}"
        log.info("%s: per-step loop not emitted as a recurrence kernel: %s", task.name, e)
        return
    except Exception as e:  # noqa: BLE001 - a bug here costs the recurrence family, not the session
        rec.error = f"{rec.error}; recurrence recognition failed: {type(e).__name__}: {e}"
        log.warning("%s: recurrence recognition failed", task.name, exc_info=True)
        return
    log.info("%s: %s", task.name, rec.recurrence.describe())


def _moe(task, rec: Recognition) -> None:
    """A reference capture refused (data-dependent sizes, ``.item()``) or captured with a loop over experts unrolled:
    recognise an expert loop in it."""
    try:
        rec.moe = recognise_moe(task)
    except MoEError as e:
        if rec.capture is None:
            rec.error = f"{rec.error}; not an expert loop KernelArc writes: {e}"
        log.info("%s: not written as an expert loop: %s", task.name, e)
        return
    except Exception as e:  # noqa: BLE001 - a bug here costs the expert-loop family, not the session
        if rec.capture is None:
            rec.error = f"{rec.error}; expert-loop recognition failed: {type(e).__name__}: {e}"
        log.warning("%s: expert-loop recognition failed", task.name, exc_info=True)
        return
    log.info("%s: %s", task.name, rec.moe.describe())


def is_varlen(site: Site) -> bool:
    return site.kind is Kind.attention and site.params.get("style") == "varlen"


def _outside(gm, sites: list[Site]) -> list[tuple]:
    """The ops of ``gm`` outside ``sites`` with their constant arguments (what the traced values decide)."""
    inside = {n for s in sites for n in s.nodes}
    out = []
    for n in gm.graph.nodes:
        if n.op == "call_function" and n not in inside:
            consts = tuple(repr(a) for a in [*n.args, *n.kwargs.values()] if not hasattr(a, "graph"))
            out.append((str(n.target), consts))
    return out


def _drop_unsafe_baked(rec: Recognition) -> None:
    """Keep a graph case with baked host-read inputs where varlen sites (always substituted) read every baked
    input and the rest of the graph is the same when traced with other values of them: it serves any values.
    Otherwise keep it for the values traced (``GraphCase.specialized``: the candidate checks them on the host
    and runs the reference on others) where another input seed gives the same values: offsets built from the
    axes, as L1/021's and L2/017's ``cu_seqlens`` (L2/017's segments' attention backward no recogniser covers).
    Such a second trace proves nothing about other values, so a varlen case with them is specialized too (until
    now it was kept as right for any values: a reference that also read the offsets outside its attention
    would have been wrong on others). Its workloads run the reference where the values move with the seed
    and no varlen site covers them (random indices)."""
    cap = rec.capture
    assert cap is not None
    keep_cases, keep_sites = [], []
    for case, sites in zip(cap.cases, rec.sites, strict=True):
        if case.baked:
            varlen = [s for s in sites if is_varlen(s) and Impl.library in rec.impls.get(id(s), ())]
            baked = {n for n in case.gm.graph.nodes if n.op == "placeholder" and "baked" in n.meta}
            alt_sites = [s for s in recognize(case.alt) if is_varlen(s)] if case.alt is not None else []
            same = case.alt is not None and _same_baked(case.gm, case.alt)
            safe = (
                bool(varlen)
                and baked <= {s.inputs["cu"] for s in varlen}
                and len(alt_sites) == len(varlen)
                and not same  # a trace with the same values proves nothing about others
                and _outside(case.gm, varlen) == _outside(case.alt, alt_sites)
            )
            if not safe and same:
                case.specialized = True
                log.info("%s: graph with host-read inputs served for the values traced (checked at run time)", rec.task)
            elif not safe:
                log.info("%s: graph with host-read inputs not served (no varlen site covers them)", rec.task)
                cap.uncovered = sorted(set(cap.uncovered) | set(case.workloads))
                continue
        keep_cases.append(case)
        keep_sites.append(sites)
    cap.cases, rec.sites = keep_cases, keep_sites
    if not cap.cases:
        rec.error = "the reference reads inputs on the host and no varlen site covers them"
        rec.capture = None


def _same_baked(a, b) -> bool:
    """Two traces of one workload hold the same baked values (their input seeds did not move them)."""
    return bool(baked_values(a)) and baked_values(a) == baked_values(b)


# ------------------------------------------------------------------------------------------
# knobs


# Inductor computes a fused chain of bf16 / fp16 ops in fp32 and rounds once, at the store; eager rounds after every
# op. Where a problem's tolerance sits at that rounding noise, torch.compile of the reference fails it (on the H200:
# L2/004 96.8%, L2/041 95.7% of elements within it, 99% required), and so does every composition that compiles the
# rest of its graph. With emulate_precision_casts Inductor rounds as eager does: on the CPU (Inductor's C++ backend,
# the smallest workload) L2/041 went from 98.07% to 100% of elements within the tolerance and L2/004 from 99.59% to
# 100%. The agents turn it on once Inductor is the suspect (``SearchAgent.inductor_fails``).
EMULATE_DOC = "rest under Inductor: each fused bf16/fp16 op rounded as eager rounds it (emulate_precision_casts)"
_LOW = (torch.bfloat16, torch.float16)


def _low_precision(gm) -> bool:
    """The graph computes on bf16 / fp16 values (where Inductor's fused numerics and eager's can differ)."""
    for n in gm.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dtype in _LOW:
            return True
    return False


def _graph_knobs(rec: Recognition) -> list[Knob]:
    kinds = set(rec.kinds())
    rest_doc = "the graph outside the substituted sites: eager aten ops or torch.compile"
    cg_doc = ("replay the call as a CUDA graph (small inputs copied into static buffers, large ones read in place by "
              "one graph per buffer set): launch-bound workloads")  # fmt: skip
    knobs = [
        Knob("rest", ("eager", "inductor"), "fusion", rest_doc),
        Knob("max_autotune", (False, True), "tiling", "Inductor max_autotune (GEMM templates, tile search)"),
        Knob("coordinate_descent", (False, True), "tiling", "Inductor coordinate-descent tuning of its Triton configs"),
        Knob("epilogue_fusion", (True, False), "fusion", "Inductor fuses pointwise epilogues into its GEMM templates"),
    ]
    if any(_low_precision(case.gm) for case in rec.capture.cases):
        knobs.append(Knob("emulate_casts", (False, True), "precision", EMULATE_DOC))
    if not any(case.baked for case in rec.capture.cases):  # host reads of offsets cannot be captured
        knobs.append(Knob("cuda_graph", (False, True), "scheduling", cg_doc))
    mm_sites = [s for case in rec.sites for s in case if s.kind in (Kind.gemm, Kind.attention)]
    fp32_mm = any((s.params.get("dtype") or s.params.get("in_dtype")) == "float32" for s in mm_sites)
    if fp32_mm:
        knobs.append(Knob("matmul_precision", ("highest", "high"), "precision", "fp32 matmuls on TF32 tensor cores"))
    if Kind.attention in kinds:
        knobs.append(Knob("sdpa_backend", SDPA_BACKENDS, "algorithmic", "SDPA backend for library attention sites"))
        if any(s.params.get("in_dtype") == "float32" and s.params.get("q_src_dtype") in ("bfloat16", "float16")
               for s in rec.substitutable(Kind.attention, Impl.library)):  # fmt: skip
            knobs.append(Knob("attn_precision", ("reference", "low"), "precision",
                              "attention on the bf16/fp16 inputs the reference upcast to fp32"))  # fmt: skip
    return knobs


def _impl_knobs(rec: Recognition, family_kind: Kind | None) -> list[Knob]:
    knobs = []
    for kind in rec.kinds():
        if kind is family_kind or not rec.substitutable(kind, Impl.library):
            continue
        knobs.append(Knob(f"{kind.value}_impl", ("library", "graph"), "algorithmic",
                          f"{kind.value} sites: one fused library call or the reference's own ops"))  # fmt: skip
    return knobs


def _start(knobs: list[Knob]) -> dict[str, Any]:
    return {k.name: k.values[0] for k in knobs}


# ------------------------------------------------------------------------------------------
# rendering


# no-ops when rest=eager
# The knobs that change nothing on the CPU, at the value that says so: a CUDA-graph replay runs the call as it is
# there, and a kernel's call traced into the rest's graph is disabled under Triton's interpreter (dynamo would
# trace into the interpreter). A CPU session's search keeps them at these values.
CPU_PINS: dict[str, Any] = {"cuda_graph": False, "trace_kernels": False}
INDUCTOR_ONLY = {"max_autotune", "coordinate_descent", "epilogue_fusion", "trace_kernels", "emulate_casts"}


def _graph_cfg(k: Mapping[str, Any]) -> GraphKnobs:
    return GraphKnobs(
        rest=k.get("rest", "eager"),
        max_autotune=bool(k.get("max_autotune", False)),
        coordinate_descent=bool(k.get("coordinate_descent", False)),
        epilogue_fusion=bool(k.get("epilogue_fusion", True)),
        cuda_graph=bool(k.get("cuda_graph", False)),
        matmul_precision=k.get("matmul_precision", "highest"),
        sdpa_backend=k.get("sdpa_backend", "auto"),
        attn_precision=k.get("attn_precision", "reference"),
        trace_kernels=bool(k.get("trace_kernels", False)),
        emulate_casts=bool(k.get("emulate_casts", False)),
    )


def render_composed(task, rec: Recognition, knobs: Mapping[str, Any], kernel: Family | None = None,
                    kernel_kind: Kind | None = None) -> str:  # fmt: skip
    """The candidate for ``knobs``: sites of ``kernel_kind`` on ``kernel`` (rendered with its knobs), the
    other sites as their ``<kind>_impl`` knob says."""
    assert rec.capture is not None
    parts: dict[str, str] = {}
    part_of: dict[tuple, str] = {}
    kernel_src = None
    if kernel is not None:
        kernel_knobs = {n.name: knobs[n.name] for n in kernel.knobs}
        kernel_src = None if kernel in GENERATED.values() else kernel.render(kernel_knobs)
    plans: list[CasePlan] = []
    for case, sites in zip(rec.capture.cases, rec.sites, strict=True):
        plan = CasePlan(case)
        for s in sites:
            impls = rec.impls.get(id(s), set())
            if not impls:
                continue
            if s.kind is kernel_kind and Impl.family in impls and kernel is not None and takes(kernel, s):
                src = kernel_src
                pkey: tuple = (kernel.name,)
                if s.kind in GENERATED:  # a kernel of its own per site (equal sites share one)
                    src = _render_generated(s, kernel_knobs, task.name)
                    pkey = (kernel.name, src)
                elif s.kind in (Kind.rmsnorm, Kind.add_rmsnorm):
                    src = patch_eps(kernel_src, float(s.params["eps"]))
                    pkey = (kernel.name, float(s.params["eps"]))
                elif s.kind is Kind.rope and rope_full_cos(s.params):
                    src = patch_rope_full_cos(kernel_src)
                    pkey = (kernel.name, "full_cos")
                elif s.kind is Kind.rope and s.params.get("style") in ("interleaved", "interleaved_complex"):
                    src = patch_rope_interleaved(kernel_src)
                    pkey = (kernel.name, "interleaved")
                elif s.kind is Kind.glu:
                    src = patch_glu_act(kernel_src, s.params["act"])
                    if s.params.get("act_round"):  # the reference rounds act(gate) before the product
                        src = patch_glu_round_act(src, s.params["act_round"])
                    if not s.params.get("packed"):  # gate and up as two tensors
                        src = patch_glu_pair(src)
                    pkey = (kernel.name, s.params["act"], bool(s.params.get("packed")), s.params.get("act_round"))
                if pkey not in part_of:
                    part_of[pkey] = f"_k{len(part_of)}_"
                    parts[part_of[pkey]] = src
                plan.sites.append(SitePlan(s, Impl.family, part_of[pkey]))
            elif Impl.library in impls and (knobs.get(f"{s.kind.value}_impl", "library") == "library" or is_varlen(s)):
                # a varlen site always runs per segment: its graph form holds the traced offsets
                plan.sites.append(SitePlan(s, Impl.library))
        plans.append(plan)
    title = f"{task.name}" + (f" with {kernel.name} kernels" if kernel else "")
    # knobs that change nothing at this point stay out of the source, so equal code has one candidate id
    shown = {n: v for n, v in knobs.items() if knobs.get("rest", "eager") != "eager" or n not in INDUCTOR_ONLY}
    return emit_module(title, shown, rec.capture, plans, parts, task.definition.reference, _graph_cfg(knobs))


def graph_level_only(family: str | None, source: str) -> bool:
    """Whether a candidate of the library family substitutes no recognised site: the reference's own graph, run
    eagerly or under Inductor with other options, with or without the CUDA-graph replay. Faster it may be, but it is
    the reference under other execution settings, not a kernel or a library substitution KernelArc built (issue 14's
    count: on the H200 suite, 10 of the 23 champions counted as built were such compositions of problems with no
    substitutable site). Read from the site list ``emit_module`` writes into the candidate's docstring, so it holds
    for a champion re-measured from the registry too."""
    if not (family or "").startswith("composed.") or not (family or "").endswith(".library"):
        return False
    head, sep, rest = source.partition("\n\nSites:\n")
    if not sep or not head.lstrip().startswith('"""KernelArc candidate composed'):
        return False
    listed = rest.split('"""', 1)[0]
    return not any(line.strip().startswith("case ") for line in listed.splitlines())


def composed_families(task) -> list[Family]:
    """The composed families of a problem (empty when its reference cannot be captured): the library
    family, and one family per KernelArc kernel family that can serve a recognised site kind."""
    from kernelarc.families import all_families

    rec = recognise(task)
    if rec.capture is None:
        if rec.recurrence is not None:
            return [f for f in [_recurrence_family(task, rec)] if _renders(f)]
        if rec.moe is not None:
            return [f for f in [_moe_family(task, rec)] if _renders(f)]
        log.info("%s: reference not captured (%s)", task.name, rec.error)
        return []
    subst = [k for k in rec.kinds() if rec.substitutable(k, Impl.library) or rec.substitutable(k, Impl.family)]
    gknobs = _graph_knobs(rec)
    out: list[Family] = []
    lib_knobs = gknobs + _impl_knobs(rec, None)
    # offered for every captured problem: even with no site to substitute, the graph-level knobs
    # (CUDA-graph replay, Inductor's tuning options) are choices torch.compile's variants do not make
    out.append(
        Family(
            name=f"composed.{task.name}.library",
            task=task.name,
            description="reference graph with recognised sites as fused library calls, graph-level knobs",
            knobs=tuple(lib_knobs),
            start=_start(lib_knobs),
            render=lambda k: render_composed(task, rec, k),
            language="pytorch",
        )
    )
    for kind in subst:
        sites = rec.substitutable(kind, Impl.family)
        if not sites:
            continue
        kernels = [GENERATED[kind]] if kind in GENERATED else [f for f in all_families().values()
                                                               if f.task in kind_tasks(kind)]  # fmt: skip
        for fam in kernels:
            if not any(takes(fam, s) for s in sites):  # sites of the dtypes it does not take keep their other impl
                log.info(
                    "%s not offered for %s: it takes %s operands, the sites are %s",
                    fam.name,
                    task.name,
                    "/".join(fam.dtypes or ()),
                    "/".join(sorted({str(s.params.get("dtype")) for s in sites})),
                )
                continue
            other = gknobs + _impl_knobs(rec, kind)
            names = {k.name for k in fam.knobs}
            other = [k for k in other if k.name not in names]
            out.append(_kernel_family(task, rec, fam, kind, other))
    if rec.moe is not None:
        out.append(_moe_family(task, rec))
    return [f for f in out if _renders(f)]


# Which kernel kind's family is tried first on a tiny budget: fp8 GEMMs of operands the reference
# dequantises to an fp32 matmul (tensor-core fp8 instead), kernels that replace what Inductor cannot
# fuse itself (attention written as matmul-softmax-matmul, fused add + norm) before the memory-bound
# ones it fuses well, and GEMMs (cuBLAS is the bar) last.
KIND_PRIORITY = (Kind.fp8_gemm, Kind.attention, Kind.add_rmsnorm, Kind.rmsnorm, Kind.group_norm, Kind.dwconv, Kind.glu,
                 Kind.rope, Kind.softmax, Kind.scatter_add, Kind.counting_sort, Kind.fused, Kind.gemm)  # fmt: skip
# float32 GEMMs run on cuBLAS's CUDA-core SGEMM in the reference and under torch.compile, where the split-precision
# family has the tensor cores: that family goes right after attention, unless the graph has fused regions. On the H200
# (runs DG-DI) it led and won where the rest of the graph is light (L1/021, L1/054, L1/072, L2/030) and led and lost
# where elementwise chains and reductions surround the GEMMs (L1/001 0.61x, L1/045 0.97x, L2/001 0.52x torch.compile's
# time): there Inductor's fusion of the rest, or the fused-region kernels, count for more than the GEMMs.
# A graph with fused regions still leads with it where its large fp32 GEMMs are most of the reference's time
# (``f32_gemm_bound``): L2/017's projections and weight gradients at 3584 x 10752, with RoPE, softmax and fused
# regions in the per-segment attention around them.
F32_GEMM_AFTER = Kind.attention
SGEMM_FLOPS = 50e12  # cuBLAS SGEMM on the H200 (run DF: 16384 x 1024 x 1024 in 0.688 ms)
COPY_BYTES_S = 4.2e12  # the H200's copy bandwidth
F32_LARGE_MNK = 2**32  # products from here on run the parts' concatenated GEMM: 1.6-2.4x SGEMM in DF
F32_GEMM_BOUND = 0.8  # share of the estimated time; DG-DI: won at 0.97 / 0.98 (L1/072, L2/030), lost at 0.65 (L2/001)


def _priority(kind: Kind, first_family: str, kinds: Collection[Kind], gemm_bound: bool = False) -> float:
    if kind is Kind.gemm and first_family == F32_NAME and (Kind.fused not in kinds or gemm_bound):
        return KIND_PRIORITY.index(F32_GEMM_AFTER) + 0.5
    return KIND_PRIORITY.index(kind)


def _coverage(rec: Recognition, kind: Kind) -> int:
    """Workloads whose graph case has a site of ``kind`` a kernel family can take."""
    assert rec.capture is not None
    return sum(
        len(case.workloads)
        for case, sites in zip(rec.capture.cases, rec.sites, strict=True)
        if any(rec.serves(s, kind, Impl.family) for s in sites)
    )


# Family calls in one graph case above which the rest of the graph starts eager: with the rest under Inductor each
# family call is a graph break (torch.compiler.disable), and every piece between two breaks is compiled on its own.
# On the H200 (run DJ, 2026-12-04) L2/017's first point, its fp32 GEMMs on the family (up to 197 calls in one case:
# the attention runs per segment) with the rest under Inductor, was still compiling when its session's time ran out,
# in both runs; its torch.compile baseline, one graph, compiled in 45 s. Of the other problems only L2/069 (14 GEMM
# sites) passes this bound.
MAX_BREAKS = 12


def _breaks(rec: Recognition, kind: Kind) -> int:
    """The most family calls of ``kind`` in one graph case (its graph breaks with the rest under Inductor)."""
    return max((sum(rec.serves(s, kind, Impl.family) for s in sites) for sites in rec.sites), default=0)


def _median_case(task, rec: Recognition) -> tuple[int, int]:
    """(graph case, workload): the case serving the median workload by bytes moved, and that workload."""
    assert rec.capture is not None
    order = sorted(range(len(task.workloads)), key=task.io_bytes)
    mid = order[len(order) // 2]
    for i, case in enumerate(rec.capture.cases):
        if mid in case.workloads:
            return i, mid
    return 0, rec.capture.cases[0].example


def f32_gemm_bound(task, rec: Recognition) -> bool:
    """Whether the median workload's large float32 GEMMs (M*N*K >= ``F32_LARGE_MNK``, not batched) take at least
    ``F32_GEMM_BOUND`` of its estimated eager time: every fp32 GEMM site at ``SGEMM_FLOPS``, every other compute op
    writing and reading its output once at ``COPY_BYTES_S``. Shapes come from running the graph on meta tensors."""
    if rec.capture is None or not rec.sites:
        return False
    ci, wl = _median_case(task, rec)
    gm = rec.capture.cases[ci].gm
    vals: dict[Any, Any] = {}

    class _Shapes(torch.fx.Interpreter):
        def run_node(self, n):  # noqa: ANN001, ANN202 - fx protocol
            vals[n] = out = super().run_node(n)
            return out

    try:
        _Shapes(gm).run(*example_inputs(task, wl))
    except Exception:  # noqa: BLE001 - an estimate only: a graph meta tensors cannot run has none
        return False

    def nbytes(v: Any) -> int:
        if isinstance(v, torch.Tensor):
            return v.numel() * v.element_size()
        return sum(nbytes(x) for x in v) if isinstance(v, list | tuple) else 0

    gemm_s = large_s = 0.0
    covered: set[Any] = set()
    for site in rec.sites[ci]:
        out, a = vals.get(site.output), vals.get(site.inputs.get("a"))
        if site.kind is not Kind.gemm or not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            continue
        if not isinstance(a, torch.Tensor):
            continue
        mnk = out.numel() * a.shape[-1]
        gemm_s += 2 * mnk / SGEMM_FLOPS
        large_s += 2 * mnk / SGEMM_FLOPS if mnk >= F32_LARGE_MNK and not site.params.get("batched") else 0.0
        covered |= site.nodes
    rest_s = sum(2 * nbytes(vals.get(n)) / COPY_BYTES_S for n in _compute_ops_of(gm) if n not in covered)
    return large_s > 0 and large_s >= F32_GEMM_BOUND * (gemm_s + rest_s)


# ops that move no data (views and size arithmetic): a graph left with only these has nothing to compile
_VIEW_OPS = {"view", "reshape", "_unsafe_view", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand",
             "slice", "select", "split", "split_with_sizes", "chunk", "unbind", "alias", "detach", "sym_size",
             "lift_fresh_copy", "_set_grad_enabled", "sym_numel", "sym_stride"}  # fmt: skip


def _compute_ops(rec: Recognition) -> list[Any]:
    """The compute ops (calls that are not views) of the first graph case; none without a capture."""
    return _compute_ops_of(rec.capture.cases[0].gm) if rec.capture is not None else []


def _compute_ops_of(gm) -> list[Any]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and op(n) is not None and op(n) not in _VIEW_OPS]


def rest_compute_ops(rec: Recognition, kind: Kind | None = None) -> int:
    """Compute ops of the first graph case that the candidate does not substitute (what torch.compile
    of the rest of the graph could still fuse): outside the sites with a library call and, with
    ``kind``, the sites of that kind on its kernel family (other kinds' family-only sites stay ops)."""
    if rec.capture is None or not rec.sites:
        return 0

    def served(s: Site) -> bool:
        impls = rec.impls.get(id(s), set())
        return Impl.library in impls or (s.kind is kind and Impl.family in impls)

    covered = {n for s in rec.sites[0] if served(s) for n in s.nodes}
    return sum(n not in covered for n in _compute_ops(rec))


# Bytes a kernel launch's time (about 5 us) moves at an H100 / H200's 3-4 TB/s: a workload that moves fewer than this
# per compute op of its graph (the eager reference launches about one kernel per op) is launch-bound.
LAUNCH_BYTES = 20 * 2**20


# ops whose CUDA implementations read a result on the host (an output size, a bin count): a CUDA-graph capture
# of a call that runs one fails ("Cannot copy between CPU and CUDA tensors during CUDA graph capture"; on the H200,
# run DR, L1/058's library composition kept bincount and its replayed point failed so, a slot of eight lost).
# Some only in some forms: _host_sync says which.
HOST_SYNC_OPS = frozenset({
    "bincount", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim", "masked_select",
    "_local_scalar_dense", "item", "histc", "argwhere", "repeat_interleave", "where", "index", "index_put",
    "index_put_",
})  # fmt: skip


def _host_sync(n: torch.fx.Node) -> bool:
    """Whether the call ``n`` reads a result on the host on CUDA (its form, not only its op: ``repeat_interleave``
    with tensor repeats and no ``output_size``, one-argument ``where``, indexing with a boolean mask)."""
    name = op(n)
    if name not in HOST_SYNC_OPS:
        return False
    if name == "repeat_interleave":  # repeats as a tensor (the .Tensor / .self_Tensor forms) without output_size
        reps = n.args[0] if len(n.args) == 1 else n.args[1] if len(n.args) > 1 else n.kwargs.get("repeats")
        return node_dtype(reps) is not None and n.kwargs.get("output_size") is None
    if name == "where":
        return len(n.args) == 1
    if name in ("index", "index_put", "index_put_"):
        idx = n.args[1] if len(n.args) > 1 else ()
        return any(node_dtype(i) in (torch.bool, torch.uint8) for i in idx)
    return True


def host_syncs(rec: Recognition, kind: Kind | None = None) -> bool:
    """Whether a graph case keeps a host-syncing call (``_host_sync``) outside the sites that ``kind``'s kernel
    family substitutes (``kind`` None: the library family's candidate, which keeps every such call). Device copies
    (``.cpu()``) are not seen here: capture traces on the meta device."""
    if rec.capture is None:
        return False
    for case, sites in zip(rec.capture.cases, rec.sites, strict=True):
        covered = {n for st in sites if kind is not None and rec.serves(st, kind, Impl.family) for n in st.nodes}
        if any(n.op == "call_function" and n not in covered and _host_sync(n) for n in case.gm.graph.nodes):
            return True
    return False


def launch_bound(task, rec: Recognition) -> bool:
    """Whether the problem's median workload moves fewer than ``LAUNCH_BYTES`` per compute op of its first graph case:
    then its launches, not its data, set its time, and CUDA-graph replay is worth an early slot (on the H200, L2/059's
    decoder layer at batch 1, 630-920 MB of weights, was left to torch.compile's 0.30 ms: its graph variants came
    after five others and the budget)."""
    n = len(_compute_ops(rec))
    if not n or not task.workloads:
        return False
    sizes = sorted(task.io_bytes(i) for i in range(len(task.workloads)))
    return sizes[len(sizes) // 2] < n * LAUNCH_BYTES


def start_points(task, families: list[Family], kernels: Mapping[str, Mapping[str, Any]] | None = None,
                 cuda: bool = True) -> list[tuple[Family, dict[str, Any]]]:  # fmt: skip
    """The first points worth measuring for a composed problem, most promising first.

    ``cuda=False`` (a session on the CPU): no CUDA-graph replays nor traced kernel calls, which run there as the
    point without them does (``CPU_PINS``) and would only take slots of the budget.

    ``kernels`` (kernel family -> knobs: the registry's champion of that family's built-in task on this
    GPU, ``kernelarc.registry.kernel_library``): each composed family of such a kernel gets, right after
    its own start point, the same point with the champion's kernel knobs (a tuned kernel for the site).

    The first kernel family of the leading recognised kind (``KIND_PRIORITY``; Triton before CUTLASS:
    nvcc builds take a minute of a tiny budget) with the rest of the graph under torch.compile when the
    graph has compute left outside the sites and the family takes at most ``MAX_BREAKS`` sites of one case (eager
    otherwise: nothing to fuse, or a compile per graph break; and the compiled
    wrapper's guards cost a launch-bound call); then the library family the same way; then the other
    kinds' first families; then the other ``rest`` value and CUDA-graph replay of the first; then the
    remaining kernel families. A launch-bound problem (``launch_bound``) has the CUDA-graph replays of the first
    point and of the library family right after the first point. Empty when ``families`` holds no composed family."""
    from kernelarc.families import all_families

    prefix = f"composed.{task.name}."
    composed = [f for f in families if f.name.startswith(prefix)]
    if not composed:
        return []
    rec = recognise(task)
    if rec.capture is None:
        return _recurrence_points(prefix, composed) or _moe_points(prefix, composed)
    registry = list(all_families())
    by_kind: dict[Kind, list[Family]] = {}
    library = None
    for f in composed:
        base_name = f.name.removeprefix(prefix)
        if base_name == "library":
            library = f
            continue
        base = all_families().get(base_name)
        kind = kind_of_task(base.task) if base is not None else None
        kind = GENERATED_KIND.get(base_name, kind)
        if kind is not None:
            by_kind.setdefault(kind, []).append(f)
    for fams in by_kind.values():
        fams.sort(key=lambda f: (f.language == "cutlass", _registry_index(registry, f.name.removeprefix(prefix))))
    # kinds whose sites most workloads have first, and the others' families only after every point of theirs:
    # L1/021's one single-segment workload (an attention its other fifteen run per segment on the library) does
    # not put the attention family ahead of its GEMMs
    total = sum(len(c.workloads) for c in rec.capture.cases)
    # the estimate runs the graph on meta tensors: only where it can move the fp32 GEMM family ahead of fused regions
    bound = (Kind.fused in by_kind and Kind.gemm in by_kind
             and by_kind[Kind.gemm][0].name.removeprefix(prefix) == F32_NAME and f32_gemm_bound(task, rec))  # fmt: skip
    minor = {k for k in by_kind if 2 * _coverage(rec, k) < total}
    kinds = sorted(by_kind, key=lambda k: (k in minor, _priority(k, by_kind[k][0].name.removeprefix(prefix),
                                                                 by_kind, bound)))  # fmt: skip
    rest_of = {k: "inductor" if rest_compute_ops(rec, k) > 0 and _breaks(rec, k) <= MAX_BREAKS else "eager"
               for k in kinds}  # fmt: skip
    rest = "inductor" if rest_compute_ops(rec) > 0 else "eager"  # the library family's
    first_rest = rest_of[kinds[0]] if kinds else rest
    other = "eager" if first_rest == "inductor" else "inductor"

    def at(f: Family | None, r: str, cuda_graph: bool = False, extra: Mapping[str, Any] | None = None
           ) -> tuple[Family, dict[str, Any]] | None:  # fmt: skip
        if f is None:
            return None
        names = {k.name for k in f.knobs}
        point = {**f.start, **(extra or {}), **({"rest": r} if "rest" in names else {})}
        if "attn_precision" in names and f in by_kind.get(Kind.attention, ()):
            # the attention kernel computes on the bf16/fp16 inputs a reference upcast to fp32: at the reference's
            # precision its sites run the library call, the library family's point
            point["attn_precision"] = "low"
        if cuda_graph and "cuda_graph" in names:
            point["cuda_graph"] = True
        try:
            point = f.check_point(point)
        except ValueError:
            return None
        return (f, point) if f.valid(point) else None

    # the library family only differs from the baselines where it substitutes a site (else, eager it is
    # the reference and compiled it is torch.compile): then only its CUDA-graph replay is worth a slot
    lib_sites = any(Impl.library in rec.impls.get(id(s), ()) for s in rec.sites[0])
    firsts = [by_kind[k][0] for k in kinds]
    order = [at(f, first_rest) for f in firsts[:1]]
    order += [at(library, rest)] if lib_sites else []
    order += [at(by_kind[k][0], rest_of[k]) for k in kinds[1:] if k not in minor]
    order += [at(firsts[0], other)] if firsts and first_rest == "inductor" else []
    # the first point's CUDA-graph replay; with the rest under Inductor, first with dynamo tracing the kernels' calls
    # (one graph: Inductor fuses the rest around them, no graph break per call). L1/061 in run DO, both replayed, the
    # mean over its two workloads: 0.062 ms traced, 0.125 ms untraced, torch.compile 0.079 ms
    traced = {"trace_kernels": True}
    replayable = bool(firsts) and "cuda_graph" in {k.name for k in firsts[0].knobs}
    graphed = (
        [at(firsts[0], first_rest, cuda_graph=True, extra=traced)] if replayable and first_rest == "inductor" else []
    )
    graphed += [at(firsts[0], first_rest, cuda_graph=True)] if firsts else []
    if firsts and host_syncs(rec, kinds[0]):
        graphed = []  # the first family's candidate keeps a host read: no capture of it can run
    graphed += [at(library, rest if lib_sites else "inductor", cuda_graph=True)] if not host_syncs(rec) else []
    if not cuda:
        graphed = []
    if launch_bound(task, rec):
        order = order[:1] + graphed + order[1:]
    elif firsts and firsts[0].name.removeprefix(prefix) in SECOND_POINT:  # data-bound: the kernel's next design first
        step = SECOND_POINT[firsts[0].name.removeprefix(prefix)]
        if firsts[0].name.removeprefix(prefix) == FUSED_NAME and _widest_fused_row(rec) > 4096:
            step = WIDE_ROWS_SECOND_POINT  # a row wider than 4096 fills both tiles' blocks alone: the same kernel
        order = order[:1] + [at(firsts[0], first_rest, extra=step)] + order[1:]
    order += graphed
    order += [at(library, "eager" if rest == "inductor" else "inductor")] if lib_sites and rest == "inductor" else []
    order += [at(f, rest_of[k]) for k in kinds for f in by_kind[k][1:] if k not in minor]
    order += [at(f, rest_of[k]) for k in kinds for f in by_kind[k] if k in minor]
    if kernels:
        order = _with_library(order, prefix, kernels)
    out: list[tuple[Family, dict[str, Any]]] = []
    seen: set[tuple[str, tuple]] = set()
    for item in order:
        if item is None:
            continue
        key = (item[0].name, tuple(sorted((k, repr(v)) for k, v in item[1].items())))
        if key not in seen:
            seen.add(key)
            out.append(item)
    # an expert loop written for all experts replaces the per-expert host reads and launches every other
    # composition keeps: its points lead
    return _moe_points(prefix, composed) + out


# A kernel family's second point where the problem moves data rather than launches (a CUDA-graph replay gains nothing
# there): the fused kernel with twice the elements per block (and, its warps 'auto', twice the warps: a wide row
# wants more threads).
# The split-precision GEMM's second point: the more accurate TF32 split after the start's bf16x3 (on the H200, bf16x3
# was the fastest split and kept 99.5% of a 1024 x 1024 x 16384 weight gradient within L1/072's 2.2e-4 + 1e-3 |C|;
# a tighter tolerance or a longer K can need tf32x3). One TF32 product as the second point was measured in run DJ and
# gained nothing: incorrect on L2/030 (98.6% of elements within its tolerance, 99% required) and correct but slower
# than bf16x3 on L1/072 (3.26 ms against 2.86 ms).
# Rows wider than 4096 are one row per block at either tile (TILE 4096 and 8192 run the same kernel there, auto warps
# 16): the second point halves the warps instead.
WIDE_ROWS_SECOND_POINT: dict[str, Any] = {"NUM_WARPS": 8}
SECOND_POINT: dict[str, dict[str, Any]] = {FUSED_NAME: {"TILE": 8192},
                                           DWCONV_NAME: {"BLOCK_R": 8, "BLOCK_L": 1024, "NUM_WARPS": 8},
                                           F32_NAME: {"PRECISION": "tf32x3"}}  # fmt: skip


def _widest_fused_row(rec: Recognition) -> int:
    """The widest row (as traced) of the fused regions of the first graph case (0 without one)."""
    regions = [s.params["_region"] for s in (rec.sites[0] if rec.sites else []) if s.kind is Kind.fused]
    return max((r.H for r in regions if r.H is not None), default=0)


def _registry_index(registry: list[str], name: str) -> int:
    return registry.index(name) if name in registry else len(registry)


def library_tasks(task, families: list[Family]) -> dict[str, set[str]]:
    """Built-in task -> the kernel families a composed problem's families use for it (what
    ``kernelarc.registry.kernel_library`` looks up)."""
    from kernelarc.families import all_families

    prefix = f"composed.{task.name}."
    out: dict[str, set[str]] = {}
    for f in families:
        base = all_families().get(f.name.removeprefix(prefix)) if f.name.startswith(prefix) else None
        if base is not None and base.task:
            out.setdefault(base.task, set()).add(base.name)
    return out


def _with_library(order: list, prefix: str, library: Mapping[str, Mapping[str, Any]]) -> list:
    """``order`` with, after the first point of each composed family whose kernel the library holds, that
    point with the library's kernel knobs (only knobs the kernel family has, with values it allows)."""
    out: list = []
    done: set[str] = set()
    for item in order:
        out.append(item)
        if item is None or item[0].name in done:
            continue
        fam, point = item
        knobs = library.get(fam.name.removeprefix(prefix))
        if not knobs:
            continue
        done.add(fam.name)
        tuned = dict(point)
        for k in fam.knobs:
            v = knobs.get(k.name)
            v = tuple(v) if isinstance(v, list) else v  # JSON (the registry's tags) has no tuples
            if k.name in knobs and v in k.values:
                tuned[k.name] = v
        try:
            tuned = fam.check_point(tuned)
        except ValueError:
            continue
        if tuned != point and fam.valid(tuned):
            out.append((fam, tuned))
    return out


def _renders(fam: Family) -> bool:
    """The family's start point emits (a graph with a node the emitter cannot write is not offered:
    the search renders points without expecting errors)."""
    try:
        fam.render(fam.start)
    except (CompositionError, AdapterError) as e:
        # a warning: no composition of the problem is searched for it (on a reference that builds a constant
        # tensor, such as ALiBi slopes, only the compile variants were, and nothing on the console said why)
        log.warning("%s not offered: %s", fam.name, e)
        return False
    return True


# The float32 GEMM family always starts on the bf16 split: one TF32 product (start from an absolute tolerance of 0.04
# on, fifteenth session) was judged in run DJ on L2/001 (atol 0.046) and was incorrect all three times, its weight
# gradients' long K putting 32% of elements outside the tolerance (max error 3.0). Whether TF32 fits a problem depends
# on its data's magnitudes, not on its tolerance alone; the search may still move PRECISION, and the guard decides.


def site_start(rec: Recognition, fam: Family, kind: Kind) -> dict[str, Any]:
    """Start values of a kernel family's own knobs that the problem's sites decide: an fp8 GEMM whose
    product the reference quantises again starts on exact bf16 MMAs (``MMA``), since the fp8 tensor
    cores' 13-bit sums then miss the problem's tolerance (Quant/004 on the H200: 91.7% of elements
    within it, 99% required). The search may still move the knobs; the guard decides."""
    names = {k.name for k in fam.knobs}
    sites = rec.substitutable(kind, Impl.family)
    out: dict[str, Any] = {}
    if kind is Kind.fp8_gemm and "MMA" in names and any(s.params.get("requant") for s in sites):
        out["MMA"] = "bf16"
    return out


# ------------------------------------------------------------------------------------------
# per-step recurrences (kernelarc.graph.recurrence)


RECURRENCE_KNOBS = (
    Knob("BLOCK", (32, 64, 128, 256, 512, 1024), "tiling", "lanes per program (each program walks every step)"),
    Knob("num_warps", (1, 2, 4, 8), "scheduling", "warps per program"),
    Knob("UNROLL", (1, 2, 4, 8, 16), "memory", "steps per loop iteration, their per-step loads issued together"),
    Knob("PREFETCH", (True, False), "memory", "the next UNROLL steps' loads issued before this chunk computes"),
    Knob("precision", ("ieee", "fast"), "precision", "fp32 division and sqrt IEEE-rounded or approximate"),
)
RECURRENCE_START = dict(RECURRENCE_DEFAULTS)
# after the start point: two lanes per thread, then more and smaller programs with deeper unrolling
RECURRENCE_POINTS = ({"BLOCK": 128, "num_warps": 2}, {"BLOCK": 32, "num_warps": 1, "UNROLL": 16})


def _recurrence_valid(k: Mapping[str, Any]) -> bool:
    return k["BLOCK"] >= 32 * k["num_warps"]  # no thread without a lane of its own


def _recurrence_family(task, rec: Recognition) -> Family:
    assert rec.recurrence is not None
    recurrence = rec.recurrence
    return Family(
        name=f"composed.{task.name}.recurrence",
        task=task.name,
        description="the reference's per-step loop as one Triton kernel: programs own lanes, carried state in "
        "registers, per-step loads unrolled",
        knobs=RECURRENCE_KNOBS,
        start=dict(RECURRENCE_START),
        render=lambda k: render_recurrence(task.name, recurrence, task.definition.reference, k),
        valid=_recurrence_valid,
        language="triton",
    )


def _recurrence_points(prefix: str, composed: list[Family]) -> list[tuple[Family, dict[str, Any]]]:
    fam = next((f for f in composed if f.name == f"{prefix}recurrence"), None)
    if fam is None:
        return []
    out: list[tuple[Family, dict[str, Any]]] = []
    for extra in ({}, *RECURRENCE_POINTS):
        point = fam.check_point({**fam.start, **extra})
        if fam.valid(point) and all(point != p for _f, p in out):
            out.append((fam, point))
    return out


# ------------------------------------------------------------------------------------------
# expert loops (kernelarc.graph.moe)

MOE_KNOBS = (
    Knob(
        "gemm",
        MOE_GEMMS,
        "algorithmic",
        "the experts' GEMMs: one torch._grouped_mm (bf16 operands in its layout), "
        "KernelArc's Triton grouped GEMM (row tiles of one expert each; fp32 rows of bf16 experts as two bf16 "
        "parts), or one mm per routed expert after one host read of the counts",
    ),
    Knob("BLOCK_M", MOE_TILES["BLOCK_M"], "tiling", "routed rows per tile of the Triton grouped GEMM"),
    Knob("BLOCK_N", MOE_TILES["BLOCK_N"], "tiling", "output columns per tile"),
    Knob("BLOCK_K", MOE_TILES["BLOCK_K"], "tiling", "reduction step"),
    Knob("num_warps", MOE_TILES["num_warps"], "scheduling", "warps per program"),
    Knob("num_stages", MOE_TILES["num_stages"], "memory", "software-pipelining stages of the K loop"),
)
# after the start: smaller row tiles (few tokens per expert), then wider column tiles on eight warps
MOE_TRITON_POINTS = ({"BLOCK_M": 32}, {"BLOCK_N": 256, "num_warps": 8})


def _moe_valid(k: Mapping[str, Any]) -> bool:
    """Tile knobs move only the Triton kernel: the other GEMMs have one point each."""
    return k["gemm"] == "triton" or all(k[n] == v for n, v in MOE_TILE_START.items())


def _moe_family(task, rec: Recognition) -> Family:
    assert rec.moe is not None
    moe = rec.moe
    return Family(
        name=f"composed.{task.name}.moe",
        task=task.name,
        description="the reference's loop over experts written once for all experts: one nonzero over the stacked "
        "masks, per-row ops on every routed row, grouped GEMMs over the expert segments, one index_add_",
        knobs=MOE_KNOBS,
        start={"gemm": "triton" if moe.ungrouped else "grouped", **MOE_TILE_START},
        render=lambda k: moe.render(dict(k)),
        valid=_moe_valid,
        language="triton",
    )


def _moe_points(prefix: str, composed: list[Family]) -> list[tuple[Family, dict[str, Any]]]:
    """The library's grouped GEMM first where it serves every GEMM (bf16 products), then the Triton kernel and
    its other tiles, then one mm per expert."""
    fam = next((f for f in composed if f.name == f"{prefix}moe"), None)
    if fam is None:
        return []
    points = [{"gemm": "grouped"}] if fam.start["gemm"] == "grouped" else []
    points += [{"gemm": "triton"}, *({"gemm": "triton", **p} for p in MOE_TRITON_POINTS), {"gemm": "loop"}]
    return [(fam, fam.check_point(p)) for p in points]


def _kernel_family(task, rec: Recognition, fam: Family, kind: Kind, other: list[Knob]) -> Family:
    kernel_names = [k.name for k in fam.knobs]
    trace_doc = "rest under Inductor: dynamo traces the kernel calls (one graph) or leaves them out (graph breaks)"
    other = [*other, Knob("trace_kernels", (False, True), "fusion", trace_doc)]

    def valid(k: Mapping[str, Any]) -> bool:
        return fam.valid({n: k[n] for n in kernel_names if n in k})

    return Family(
        name=f"composed.{task.name}.{fam.name}",
        task=task.name,
        description=f"reference graph with its {kind.value} sites on {fam.name}: {fam.description}",
        knobs=tuple(fam.knobs) + tuple(other),
        start={**dict(fam.start), **site_start(rec, fam, kind), **_start(other)},
        render=lambda k: render_composed(task, rec, k, kernel=fam, kernel_kind=kind),
        valid=valid,
        language=fam.language,
    )
