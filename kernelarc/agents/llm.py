"""The ``anthropic`` agent backend: Claude writes candidate kernels.

``AnthropicAgent`` implements the Agent protocol (kernelarc.agents.base). Each proposal is one
Messages API call per candidate (plus at most one short repair turn), with

- a system prompt whose blocks are all static for a session (rules, task, workloads and
  tolerances, hardware target, strategy brief; ``cache_control`` on the last block, so the
  tools + system prefix is cached across calls and agents of the same strategy),
- a user turn with what changes: the champion, this agent's recent attempts and their verdicts
  (errors trimmed), the board findings, the plateau redirect, and the request,
- a forced tool call ``submit_kernel`` for a structured reply that is validated (one tool
  call, complete, parseable Python defining ``run``, an allowed language, one file only).

Failures never raise out of ``propose`` except ``AgentConfigError`` (invalid key): a malformed
reply gets one repair turn, then becomes a line in ``Proposal.failures``; an API outage is
retried (SDK retries + our bounded, jittered backoff honouring retry-after) and then recorded.
Token usage and USD cost are returned in ``Proposal.cost``. The API key is read from
``ANTHROPIC_API_KEY`` only and never appears in logs, errors, proposals or ``repr``.

The knob helpers ``knob_space_of`` / ``render_with_knobs`` let offline search agents tune an
LLM kernel: the model writes tunables as module-level UPPER_CASE constants and declares their
allowed values in a module-level ``KNOBS = {...}`` dict literal.
"""

from __future__ import annotations

import ast
import logging
import math
import os
import random
import re
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from email.utils import mktime_tz, parsedate_tz
from typing import Any

from kernelarc.agents.base import AgentContext, Proposal
from kernelarc.dispatch import FAMILY as DISPATCH_FAMILY
from kernelarc.guard.static import allowed_imports
from kernelarc.models import LANGUAGES, Candidate, Finding, Verdict

log = logging.getLogger(__name__)

TOOL_NAME = "submit_kernel"
KNOBS_NAME = "KNOBS"
ERROR_CHARS = 1500  # per attempt, after trimming
CONCLUSION_CHARS = 200
RATIONALE_CHARS = 300
SOURCE_CHARS = 24_000  # longest source quoted back into a prompt
COST_KEYS = ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens", "usd", "calls")


class AgentConfigError(RuntimeError):
    """The agent cannot work as configured (no key, invalid key). Never contains the key."""


class _APIFailure(Exception):
    """An API call failed after all retries (message already redacted)."""

    conclusion: str = ""


class _Malformed(Exception):
    """The reply did not pass validation (message is sent back in the repair turn)."""

    conclusion: str = ""  # the reply's conclusion, salvaged even when its kernel is rejected


# ======================================================================================
# Knob helpers (hybrid LLM + offline tuning)
# ======================================================================================


def _is_literal_value(v: Any) -> bool:
    if v is None or isinstance(v, bool | int | float | str):
        return not (isinstance(v, float) and not math.isfinite(v))
    if isinstance(v, list | tuple):
        return all(_is_literal_value(x) for x in v)
    return False


def _same(a: Any, b: Any) -> bool:
    """Equality that does not confuse True with 1 or 1 with 1.0."""
    if type(a) is not type(b):
        return False
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def _bound_names(target: ast.AST) -> list[str]:
    return [n.id for n in ast.walk(target) if isinstance(n, ast.Name)]


def _module_bindings(tree: ast.Module) -> tuple[dict[str, list[ast.AST]], dict[str, ast.expr], set[str]]:
    """Module-scope bindings: name -> binding statements; the simple ``NAME = value`` (or
    ``NAME: T = value``) assignments directly in the module body; names declared ``global``
    anywhere (rebindable from functions)."""
    bindings: dict[str, list[ast.AST]] = {}
    simple: dict[str, ast.expr] = {}
    globals_: set[str] = set()

    def add(name: str, node: ast.AST) -> None:
        bindings.setdefault(name, []).append(node)

    def visit(stmts: list[ast.stmt], top: bool) -> None:
        for s in stmts:
            if isinstance(s, ast.Assign):
                for t in s.targets:
                    for n in _bound_names(t):
                        add(n, s)
                if top and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name):
                    simple.setdefault(s.targets[0].id, s.value)
            elif isinstance(s, ast.AnnAssign):
                for n in _bound_names(s.target):
                    add(n, s)
                if top and isinstance(s.target, ast.Name) and s.value is not None:
                    simple.setdefault(s.target.id, s.value)
            elif isinstance(s, ast.AugAssign):
                for n in _bound_names(s.target):
                    add(n, s)
            elif isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                add(s.name, s)
            elif isinstance(s, ast.Import | ast.ImportFrom):
                for a in s.names:
                    add((a.asname or a.name).split(".")[0], s)
            elif isinstance(s, ast.For | ast.AsyncFor):
                for n in _bound_names(s.target):
                    add(n, s)
                visit(s.body, False)
                visit(s.orelse, False)
            elif isinstance(s, ast.With | ast.AsyncWith):
                for item in s.items:
                    if item.optional_vars is not None:
                        for n in _bound_names(item.optional_vars):
                            add(n, s)
                visit(s.body, False)
            elif isinstance(s, ast.If | ast.While):
                visit(s.body, False)
                visit(s.orelse, False)
            elif isinstance(s, ast.Try):
                visit(s.body, False)
                for h in s.handlers:
                    if h.name:
                        add(h.name, h)
                    visit(h.body, False)
                visit(s.orelse, False)
                visit(s.finalbody, False)

    visit(tree.body, True)
    for node in ast.walk(tree):
        if isinstance(node, ast.Global):
            globals_.update(node.names)
        elif isinstance(node, ast.NamedExpr):
            globals_.add(node.target.id)  # conservative: a walrus may rebind a module name
    return bindings, simple, globals_


def _knob_constant(name: str, bindings: dict[str, list[ast.AST]], simple: dict[str, ast.expr], globals_: set[str]):
    """The constant a knob reads from: ``name`` itself, else ``name.upper()``, provided it is
    bound exactly once at module scope by a simple literal assignment and never rebound."""
    for const in dict.fromkeys((name, name.upper())):
        if const in simple and len(bindings.get(const, ())) == 1 and const not in globals_:
            try:
                value = ast.literal_eval(simple[const])
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            if _is_literal_value(value):
                return const, simple[const], value
            return None
    return None


def _source_of(candidate: Candidate | str) -> str:
    return candidate.source if isinstance(candidate, Candidate) else str(candidate)


def _parse_knobs(source: str):
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    bindings, simple, globals_ = _module_bindings(tree)
    if KNOBS_NAME not in simple or len(bindings.get(KNOBS_NAME, ())) != 1:
        return None
    try:
        space = ast.literal_eval(simple[KNOBS_NAME])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return None
    if not isinstance(space, dict):
        return None
    out: dict[str, tuple[list[Any], str, ast.expr, Any]] = {}
    for name, values in space.items():
        if not isinstance(name, str) or not isinstance(values, list | tuple) or not values:
            continue
        found = _knob_constant(name, bindings, simple, globals_)
        if found is None:
            continue
        const, node, current = found
        vals: list[Any] = []
        for v in values:
            if _is_literal_value(v) and not any(_same(v, w) for w in vals):
                vals.append(v)
        if not any(_same(current, w) for w in vals):
            vals.insert(0, current)  # the space always contains the point the source is at
        out[name] = (vals, const, node, current)
    return out


def knob_space_of(candidate: Candidate | str) -> dict[str, list[Any]]:
    """Allowed values of each knob of a candidate (or source text).

    Read from a module-level ``KNOBS = {"NAME": [v1, v2, ...], ...}`` dict literal. A knob
    counts only if its constant (``NAME``, or ``NAME.upper()``) is assigned exactly once at
    module level with a literal and never rebound; the constant's current value is always in
    the returned list. Returns ``{}`` when there is no usable ``KNOBS`` literal.
    """
    parsed = _parse_knobs(_source_of(candidate))
    return {} if not parsed else {k: list(v[0]) for k, v in parsed.items()}


def knob_values_of(candidate: Candidate | str) -> dict[str, Any]:
    """Current value of each knob in ``knob_space_of`` (what the source is set to)."""
    parsed = _parse_knobs(_source_of(candidate))
    return {} if not parsed else {k: v[3] for k, v in parsed.items()}


_LINE_RE = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+$")


def render_with_knobs(source: str, values: Mapping[str, Any]) -> str:
    """Rewrite the knob constants' assignments of ``source`` to ``values`` (knob name -> value).

    AST-located, text-preserving edits: only the right-hand side of each knob constant changes
    (comments, formatting and the ``KNOBS`` literal stay). Raises ``ValueError`` for an unknown
    knob or a value outside its declared list.
    """
    parsed = _parse_knobs(source)
    if parsed is None:
        raise ValueError(f"source declares no usable module-level {KNOBS_NAME} = {{...}} dict literal")
    edits: list[tuple[int, int, str]] = []
    lines = _LINE_RE.findall(source)
    starts = [0]
    for ln in lines:
        starts.append(starts[-1] + len(ln.encode()))
    for name, value in values.items():
        if name not in parsed:
            raise ValueError(f"unknown knob {name!r}; knobs: {sorted(parsed)}")
        allowed, _const, node, _cur = parsed[name]
        if not any(_same(value, a) for a in allowed):
            raise ValueError(f"knob {name!r}: value {value!r} not in {allowed}")
        start = starts[node.lineno - 1] + node.col_offset
        end = starts[node.end_lineno - 1] + node.end_col_offset
        edits.append((start, end, repr(value)))
    data = source.encode()
    for start, end, text in sorted(edits, reverse=True):
        data = data[:start] + text.encode() + data[end:]
    out = data.decode()
    check = _parse_knobs(out)
    if check is None:
        raise ValueError("rendering broke the source")  # pragma: no cover - defensive
    for name, value in values.items():
        if not _same(check[name][3], value):  # pragma: no cover - defensive
            raise ValueError(f"rendering did not set {name!r}")
    return out


def _insert_knobs_literal(source: str, space: Mapping[str, list[Any]]) -> str:
    """Add a ``KNOBS = {...}`` literal after the module docstring/imports of ``source``."""
    tree = ast.parse(source)
    after = 0
    for s in tree.body:
        if isinstance(s, ast.Import | ast.ImportFrom) or (
            isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant) and isinstance(s.value.value, str)
        ):
            after = s.end_lineno or after
        else:
            break
    literal = "KNOBS = {" + ", ".join(f"{k!r}: {list(v)!r}" for k, v in space.items()) + "}\n"
    lines = _LINE_RE.findall(source)
    if after and not lines[after - 1].endswith(("\n", "\r")):
        lines[after - 1] += "\n"
    return "".join(lines[:after]) + ("\n" if after else "") + literal + ("\n" if after else "") + "".join(lines[after:])


# ======================================================================================
# Error trimming and prompt rendering
# ======================================================================================

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_LIB_FRAME = re.compile(r'^\s*File "[^"]*(?:site-packages|dist-packages|/lib/python\d[^"/]*/|<frozen )[^"]*"')
_NUMBERS = re.compile(r"[-+]?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def trim_error(text: str, limit: int = ERROR_CHARS) -> str:
    """Cut a compile error / traceback / mismatch report down to its useful lines.

    Drops library traceback frames (site-packages, stdlib), keeps the candidate's frames and
    the final exception, collapses runs of similar lines (per-workload mismatch lines that
    differ only in numbers) to the first three, then keeps head and tail within ``limit``.
    """
    text = _ANSI.sub("", str(text or "")).strip()
    if not text:
        return ""
    out: list[str] = []
    skipping = False
    dropped = 0
    for ln in text.splitlines():
        if _LIB_FRAME.match(ln):
            skipping = True
            dropped += 1
            continue
        if skipping and ln.startswith("    ") and not ln.lstrip().startswith("File "):
            continue
        skipping = False
        out.append(ln.rstrip())
    if dropped:
        at = next((i + 1 for i, ln in enumerate(out) if ln.startswith("Traceback")), 0)
        out.insert(at, f"  [{dropped} library frame(s) omitted]")
    counts: dict[str, int] = {}
    kept: list[str] = []
    similar = 0
    for ln in out:
        key = _NUMBERS.sub("#", ln)
        counts[key] = counts.get(key, 0) + 1
        if counts[key] <= 3 or not ln.strip():
            kept.append(ln)
        else:
            similar += 1
    if similar:
        kept.append(f"[{similar} similar line(s) omitted]")
    text = "\n".join(kept)
    if len(text) <= limit:
        return text
    head = limit // 3
    tail = max(0, limit - head - 40)
    return (
        text[:head].rstrip() + f"\n[... {len(text) - head - tail} chars cut ...]\n" + text[len(text) - tail :].lstrip()
    )


def _one_line(text: Any, limit: int) -> str:
    s = " ".join(str(text or "").split())
    return s if len(s) <= limit else s[: limit - 1].rstrip() + "…"


def _num(x: Any, digits: int = 4) -> str:
    if x is None:
        return "n/a"
    try:
        return f"{float(x):.{digits}g}"
    except (TypeError, ValueError):
        return str(x)


def _pct(x: Any) -> str:
    return "n/a" if x is None else f"{100 * float(x):.1f}%"


def _clip_source(src: str) -> str:
    if len(src) <= SOURCE_CHARS:
        return src
    return src[: SOURCE_CHARS - 200] + f"\n# [... {len(src) - SOURCE_CHARS + 200} chars cut ...]\n"


def _fence(src: str) -> str:
    return f"```python\n{_clip_source(src).rstrip()}\n```"


def _verdict_metrics(v: Verdict) -> str:
    parts = [f"status {v.status.value}"]
    if v.latency_ms is not None:
        parts.append(f"latency {_num(v.latency_ms)} ms (geo-mean over workloads)")
    if v.speedup_vs_baseline is not None:
        parts.append(f"speedup vs baseline {_num(v.speedup_vs_baseline, 3)}x")
    if v.speedup_vs_champion is not None:
        parts.append(f"vs champion {_num(v.speedup_vs_champion, 3)}x")
    if v.sol_fraction is not None:
        parts.append(f"SOL fraction {_pct(v.sol_fraction)}")
    if v.tflops is not None:
        parts.append(f"{_num(v.tflops)} TFLOP/s")
    if v.tbps is not None:
        parts.append(f"{_num(v.tbps)} TB/s")
    return ", ".join(parts)


def _workload_table(v: Verdict, limit: int = 16) -> list[str]:
    rows = []
    for w in v.workloads[:limit]:
        axes = ", ".join(f"{k}={val}" for k, val in w.axes.items())
        bits = [f"w{w.index} ({axes})"]
        if w.latency_ms is not None:
            bits.append(f"{_num(w.latency_ms)} ms")
        if w.sol_fraction is not None:
            bits.append(f"SOL {_pct(w.sol_fraction)}" + (f" ({w.sol_bound}-bound)" if w.sol_bound else ""))
        if w.speedup_vs_baseline is not None:
            bits.append(f"{_num(w.speedup_vs_baseline, 3)}x vs baseline")
        rows.append("  - " + ", ".join(bits))
    if len(v.workloads) > limit:
        rows.append(f"  - ... {len(v.workloads) - limit} more workloads")
    return rows


def _verdict_errors(v: Verdict) -> str:
    parts = [str(e) for e in v.errors]
    bad = [w for w in v.workloads if w.error or (w.correct is False and v.status.value == "incorrect")]
    for w in bad[:6]:
        axes = ", ".join(f"{k}={val}" for k, val in w.axes.items())
        detail = w.error or (
            f"mismatch: max_abs_err {_num(w.max_abs_err)}, rel_err {_num(w.rel_err)}, "
            f"matched {_pct(w.matched_ratio) if w.matched_ratio is not None else 'n/a'}"
        )
        parts.append(f"workload {w.index} ({axes}): {detail}")
    if len(bad) > 6:
        parts.append(f"... {len(bad) - 6} more failing workloads")
    return trim_error("\n".join(parts), ERROR_CHARS)


def _fmt_finding(f: Finding) -> str:
    gain = "" if f.gain is None else f" gain {100 * f.gain:+.1f}%"
    fam = f" family {f.family}" if f.family else ""
    knobs = f" knobs {dict(f.knobs)}" if f.knobs else ""
    return f"- [{f.agent}/{f.strategy}] {f.candidate_id} {f.status.value}{gain}{fam}{knobs}: {_one_line(f.lesson, 300)}"


def _target_text(target: Any) -> str:
    """The hardware target's ceilings (kernelarc.hardware.GpuTarget, or any object/mapping with
    name, arch, sm_count, peak_tflops, hbm_tbps and optionally simt_tflops, l2_mb,
    smem_kb_per_sm, memory_gb, calibrated)."""
    if target is None:
        return "## Hardware target\n(unknown)"

    def get(k: str) -> Any:
        return target.get(k) if isinstance(target, Mapping) else getattr(target, k, None)

    lines = ["## Hardware target"]
    lines.append(f"- name: {get('name')}, arch: {get('arch')}, SMs: {get('sm_count')}")
    peaks = get("peak_tflops") or {}
    if isinstance(peaks, Mapping) and peaks:
        lines.append("- peak dense tensor-core TFLOP/s: " + ", ".join(f"{k} {_num(v)}" for k, v in peaks.items()))
    simt = get("simt_tflops") or {}
    if isinstance(simt, Mapping) and simt:
        lines.append("- non-tensor (SIMT) TFLOP/s: " + ", ".join(f"{k} {_num(v)}" for k, v in simt.items()))
    hbm = get("hbm_tbps")
    if hbm:
        lines.append(f"- HBM bandwidth: {_num(hbm)} TB/s")
        if isinstance(peaks, Mapping):
            for key in ("bfloat16", "bf16", "float16", "fp16"):
                if peaks.get(key):
                    ridge = float(peaks[key]) / float(hbm)
                    lines.append(f"- ridge point ({key}): ~{ridge:.0f} FLOP/byte; below it a kernel is memory-bound")
                    break
    sizes = [
        f"{label} {_num(get(k))} {unit}"
        for k, label, unit in (
            ("l2_mb", "L2", "MB"),
            ("smem_kb_per_sm", "shared memory per SM", "KB"),
            ("memory_gb", "device memory", "GB"),
        )
        if get(k)
    ]
    if sizes:
        lines.append("- " + ", ".join(sizes))
    cal = get("calibrated") or {}
    if isinstance(cal, Mapping) and cal:
        lines.append("- measured on this machine: " + ", ".join(f"{k} {_num(v)}" for k, v in cal.items()))
    lines.append(
        "SOL fraction = roofline time (max of FLOPs / peak of the dtype, unique input+output bytes / HBM "
        "bandwidth) / measured time; 100% is the speed of light."
    )
    return "\n".join(lines)


def _task_text(task: Any) -> str:
    d = task.definition
    lines = [f"## Task: {d.name}"]
    if d.description:
        lines.append(d.description)
    lines.append("\n### Axes")
    for name, ax in d.axes.items():
        kind = ax.type
        extra = f" = {ax.value}" if kind == "const" else (f" = {ax.expression}" if kind == "expr" else "")
        desc = f" — {ax.description}" if getattr(ax, "description", None) else ""
        lines.append(f"- {name}: {kind}{extra}{desc}")
    if d.constraints:
        lines.append("Constraints: " + "; ".join(d.constraints))
    for title, specs in (("Inputs (run's arguments, in this order)", d.inputs), ("Outputs (in this order)", d.outputs)):
        lines.append(f"\n### {title}")
        for name, spec in specs.items():
            shape = "scalar" if spec.shape is None else "[" + ", ".join(str(s) for s in spec.shape) + "]"
            desc = f" — {spec.description}" if spec.description else ""
            lines.append(f"- {name}: {shape} {spec.dtype}{desc}")
    lines.append("\n### Reference (PyTorch; defines the semantics and the baseline time)")
    lines.append(_fence(d.reference))
    lines.append(f"\n### Workloads ({len(task.workloads)}; every one must pass, timing is the geo-mean)")
    shown = 40
    for i, wl in enumerate(task.workloads[:shown]):
        try:
            axes = task.axes(i)
        except Exception:  # noqa: BLE001 - show what the file says
            axes = dict(wl.axes)
        axes_s = ", ".join(f"{k}={v}" for k, v in axes.items())
        scal = [f"{n}={desc.value!r}" for n, desc in wl.inputs.items() if getattr(desc, "type", "") == "scalar"]
        other = sorted({getattr(desc, "type", "?") for desc in wl.inputs.values()} - {"scalar", "random"})
        tols = []
        for out in d.outputs:
            try:
                atol, rtol, ratio = task.tolerance(i, out)
                tols.append(f"{out}: atol {atol:g}, rtol {rtol:g}, matched >= {ratio:g}")
            except Exception:  # noqa: BLE001
                pass
        line = f"- w{i}: {axes_s}"
        if scal:
            line += "; scalars " + ", ".join(scal)
        if other:
            line += "; inputs from " + ", ".join(other)
        if tols:
            line += "; tolerance " + "; ".join(tols)
        lines.append(line)
    if len(task.workloads) > shown:
        lines.append(f"- ... {len(task.workloads) - shown} more workloads of the same kind")
    return "\n".join(lines)


def _rules_text(languages: Sequence[str], knob_tuning: bool) -> str:
    langs = ", ".join(languages)
    text = f"""You are a GPU kernel engineer on KernelArc, a team of agents that each optimize one kernel under one
strategy. You propose one candidate at a time. A deterministic guard checks it on fresh random inputs (several
seeds, every workload, outputs poisoned before each call, NaN/Inf and all-zero outputs rejected) and times it (warm-up,
L2 flushed between iterations, rotating input buffers, median of many iterations). A candidate becomes the champion
only if it is correct on every workload and measurably faster than the current champion, measured side by side.

## Rules for a candidate (violations are rejected before anything runs)
- Exactly one self-contained Python file: no markdown fences, no second file, no diff.
- It defines `run(...)` taking the definition's inputs positionally, in the definition's order and with their names,
  and returns the outputs (one tensor, or a tuple in the definition's output order) as fresh tensors it allocated:
  never an input, a view or alias of an input, or a lazy/unmaterialized tensor.
- language is one of: {langs}. triton: @triton.jit kernels launched from run (Triton 3.6;
  use tensor descriptors `tl.make_tensor_descriptor` with `triton.set_allocator` rather than the deprecated
  `tl.make_block_ptr`).
  cutlass: a module-level string `CPP` of CUDA C++ on the CUTLASS 3.x / CuTe headers (built with nvcc for sm_90a),
  loaded at import with `from kernelarc import cutlass as _cutlass` and `_K = _cutlass.load(CPP)` (the only
  KernelArc import allowed; it compiles and caches the library). The C++ must export
  `extern "C" size_t kernelarc_workspace(const long long* dims)` and `extern "C" int kernelarc_run(const void* const*
  in, void* const* out, const long long* dims, void* workspace, void* stream)` (0 on success, launching on `stream`);
  run allocates the outputs and calls `_K([inputs], [outputs], [dims])` with contiguous CUDA tensors. Tunable
  values go into CPP from UPPER_CASE Python constants (e.g. `CPP = TEMPLATE.replace("TILE_M_", str(TILE_M))`).
  Besides the CUTLASS/CuTe headers, CUTLASS's example kernels are on the include path (e.g. the Hopper FMHA:
  `#include "88_hopper_fmha/kernel/fmha_kernel_builder.hpp"`, as in templates/cutlass/fmha_sm90.cu.in). The C++
  may include only CUTLASS, CuTe, CUDA's headers and computational standard headers, and may not use loaders
  (dlopen/dlsym), the Python C API, threads, processes, files, host callbacks, system calls, constructors or `##`:
  such C++ is rejected as a hack.
  pytorch: PyTorch operators only.
- Imports: only {allowed_imports()}; any other module is rejected.
- Forbidden: threads, processes, subprocess/multiprocessing, side CUDA streams or events, caching outputs or inputs
  across calls (memoized results, global buffers that carry results), reading the reference's results, printing or
  logging, writing files, network access, monkey-patching torch/triton/time or any other module, changing
  environment variables. Do not call the reference. torch.compile takes `mode` and `backend` by name and `options`
  only as a literal dict of flags and numbers.
- Outputs must match the reference within each workload's tolerance; lower precision is allowed only where the
  tolerance leaves room for it.
- Prefer fixed launch configurations over `@triton.autotune` (timing must be reproducible)."""
    if knob_tuning:
        text += """
- Tunable parameters (block sizes, num_warps, num_stages, group sizes, split counts): read each one from a
  module-level UPPER_CASE constant assigned exactly once with a literal (e.g. `BLOCK_M = 128`, never reassigned),
  and declare the allowed values in a module-level dict literal whose keys are those constant names, e.g.
  `KNOBS = {"BLOCK_M": [64, 128, 256], "NUM_WARPS": [4, 8]}`. Every listed value must give a correct kernel for
  every workload. Pass the same dict in the tool's `knobs` field. An offline tuner sweeps these values later."""
    text += f"""

## How to answer
Call the tool `{TOOL_NAME}` exactly once with the complete file. `conclusion`: one line (at most {CONCLUSION_CHARS}
characters) for your teammates about what your previous attempt showed and why; empty if you have none.
`rationale`: one line on why this candidate should beat the champion."""
    return text


def build_system_blocks(
    ctx: AgentContext, brief: str, strategy: str, *, knob_tuning: bool = True, languages: Sequence[str] = LANGUAGES
) -> list[dict[str, Any]]:
    """The static system prompt: identical for every call of a session (so it is cached).
    ``cache_control`` is on the last block."""
    blocks = [
        {"type": "text", "text": _rules_text(languages, knob_tuning)},
        {"type": "text", "text": _task_text(ctx.task) + "\n\n" + _target_text(ctx.target)},
        {"type": "text", "text": f"## Your strategy: {strategy}\n\n{brief.strip()}"},
    ]
    blocks[-1]["cache_control"] = {"type": "ephemeral"}
    return blocks


def _champion_source(ctx: AgentContext) -> list[str]:
    """The champion's code. A shape dispatch (kernelarc.dispatch) is summarised instead of pasted
    whole (it holds every part's module): its routes, and the source of its default kernel."""
    champ = ctx.champion
    if champ is None or champ.family != DISPATCH_FAMILY:
        return [_fence(champ.source)] if champ is not None else []
    routes = ", ".join(f"{k}: {v}" for k, v in sorted(champ.knobs.items()) if k != "default")
    out = [
        "The champion is a shape dispatch the session composed from searched kernels (candidate ids per "
        f"workload: {routes}; any other shape: {champ.knobs.get('default')}). Propose one kernel as usual: a "
        "kernel that is fastest on some workloads is folded into the dispatch automatically."
    ]
    default = next((c for c, _ in ctx.backups if c.id == champ.knobs.get("default")), None)
    if default is not None:
        out += [f"Its default kernel ({default.id}, {default.family or default.language}):", _fence(default.source)]
    return out


def build_user_prompt(
    ctx: AgentContext,
    attempts: Sequence[tuple[Candidate, Verdict]],
    *,
    strategy: str,
    history_limit: int = 4,
    this_round: Sequence[Candidate] = (),
    ask_conclusion: bool = True,
) -> str:
    """The dynamic part: champion, own recent attempts with verdicts, board, redirect, request."""
    out: list[str] = []
    champ = ctx.champion
    if champ is not None:
        out.append(f"## Current champion: {champ.id} (by {champ.agent}, {champ.strategy}, {champ.language})")
        if ctx.champion_verdict is not None:
            out.append(_verdict_metrics(ctx.champion_verdict))
            out.extend(_workload_table(ctx.champion_verdict))
        out.extend(_champion_source(ctx))
    else:
        out.append("## Current champion: none yet. The time to beat is the PyTorch reference (the baseline).")

    recent = list(attempts)[-history_limit:] if history_limit > 0 else []
    if recent:
        out.append(f"\n## Your recent attempts (oldest first; {len(attempts)} in total)")
        for k, (cand, ver) in enumerate(recent):
            last = k == len(recent) - 1
            tag = " — your previous attempt" if last else ""
            out.append(f"\n### {cand.id} ({cand.language}){tag}")
            if cand.rationale:
                out.append(f"rationale: {_one_line(cand.rationale, RATIONALE_CHARS)}")
            if cand.knobs:
                out.append(f"knobs: {dict(cand.knobs)}")
            out.append(_verdict_metrics(ver))
            errs = _verdict_errors(ver)
            if errs:
                out.append("errors:\n" + errs)
            if ver.warnings:
                out.append("warnings: " + trim_error("\n".join(map(str, ver.warnings)), 400))
            if last:
                if champ is not None and cand.id == champ.id:
                    out.append("(source: the champion above)")
                else:
                    out.append(_fence(cand.source))
    if ctx.findings:
        out.append(f"\n## Board: conclusions shared by the team ({len(ctx.findings)})")
        out.extend(_fmt_finding(f) for f in ctx.findings)
    if ctx.redirect:
        out.append(f"\n## Redirect from the plateau detector\n{ctx.redirect.strip()}")
        if ctx.backups:
            bc, bv = min(ctx.backups, key=lambda cv: cv[1].latency_ms if cv[1].latency_ms is not None else math.inf)
            out.append(f"A correct but slower backup you may branch from: {bc.id} ({_verdict_metrics(bv)})")
            out.append(_fence(bc.source))
    if this_round:
        out.append("\n## Already proposed in this round (propose something different)")
        out.extend(f"- {c.id}: {_one_line(c.rationale, RATIONALE_CHARS)}" for c in this_round)

    out.append("\n## Request")
    req = f"Write one new candidate under the {strategy} strategy that is correct on every workload and faster than "
    req += "the champion." if champ is not None else "the reference."
    req += " It must differ from every earlier candidate."
    if ctx.budget_left is not None:
        req += f" {ctx.budget_left} candidate evaluations are left in this session."
    if recent and ask_conclusion:
        cand, ver = recent[-1]
        req += (
            f" In `conclusion`, state in one line what your previous attempt {cand.id} ({ver.status.value}) showed"
            " and why, so teammates can learn from it."
        )
    else:
        req += " Leave `conclusion` empty."
    req += f" Call `{TOOL_NAME}` exactly once."
    out.append(req)
    return "\n".join(out)


def submit_tool(languages: Sequence[str] = LANGUAGES, knob_tuning: bool = True) -> dict[str, Any]:
    props: dict[str, Any] = {
        "conclusion": {
            "type": "string",
            "description": "One line about your previous attempt for the team board (what it showed, why). "
            "Empty string if there was none.",
        },
        "rationale": {"type": "string", "description": "One line: why this candidate should be faster."},
        "language": {"type": "string", "enum": list(languages)},
        "source": {
            "type": "string",
            "description": "The complete Python file defining run(...). One file only, no markdown fences.",
        },
    }
    if knob_tuning:
        props["knobs"] = {
            "type": "object",
            "description": "Optional. Knob name (the module-level UPPER_CASE constant) -> list of allowed values; "
            "the same dict as the file's KNOBS literal.",
            "additionalProperties": {"type": "array", "items": {}, "minItems": 1},
        }
    return {
        "name": TOOL_NAME,
        "description": "Submit exactly one candidate kernel file for the guard to check and time.",
        "input_schema": {
            "type": "object",
            "properties": props,
            "required": ["conclusion", "rationale", "language", "source"],
        },
    }


# ======================================================================================
# Reply validation
# ======================================================================================

_FILE_MARKER = re.compile(
    r"^\s*(?:(?:#|//)+\s*(?:file(?:name)?|path)\s*[:=]\s*\S+"
    r"|={3,}\s*\S+\.(?:py|cu|cuh|cpp|cc|h|hpp)\b"
    r"|-{3}\s+(?:a/)?\S+\.(?:py|cu|cuh|cpp|h)\b"
    r"|\+{3}\s+(?:b/)?\S+\.(?:py|cu|cuh|cpp|h)\b"
    r"|#{2,}\s*\S+\.(?:py|cu|cuh|cpp|h)\s*$)",
    re.IGNORECASE | re.MULTILINE,
)
_ENCLOSING_FENCE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n```\s*$", re.DOTALL)


@dataclass
class _Reply:
    source: str
    language: str
    conclusion: str
    rationale: str
    knobs: dict[str, list[Any]]


def _check_source(source: str, n_inputs: int) -> str:
    """Return the (possibly unfenced) source or raise _Malformed."""
    if not isinstance(source, str) or not source.strip():
        raise _Malformed("`source` is empty: send the complete Python file")
    m = _ENCLOSING_FENCE.match(source)
    if m and "```" not in m.group(1):
        source = m.group(1) + "\n"  # one file wrapped in a markdown fence: unwrap it
    if "```" in source and source.count("```") >= 2:
        try:
            ast.parse(source)
        except SyntaxError:
            raise _Malformed("`source` contains markdown fences: send one plain Python file, no fences") from None
    markers = _FILE_MARKER.findall(source)
    if len(markers) >= 2:
        raise _Malformed(
            f"`source` looks like several files ({len(markers)} file markers such as {markers[0].strip()!r}): "
            "send exactly one self-contained Python file"
        )
    try:
        tree = ast.parse(source)
    except SyntaxError as e:
        line = (e.text or "").rstrip()
        raise _Malformed(f"`source` is not valid Python: {e.msg} at line {e.lineno}: {line[:200]}") from None
    except ValueError as e:  # null bytes
        raise _Malformed(f"`source` is not valid Python: {e}") from None
    runs = [s for s in tree.body if isinstance(s, ast.FunctionDef | ast.AsyncFunctionDef) and s.name == "run"]
    if not runs:
        raise _Malformed("`source` must define a module-level function `run(...)` (the entry point)")
    fn = runs[-1]
    if isinstance(fn, ast.AsyncFunctionDef):
        raise _Malformed("`run` must be a plain function, not async")
    a = fn.args
    positional = len(a.posonlyargs) + len(a.args)
    if a.vararg is None and positional != n_inputs:
        raise _Malformed(f"`run` takes {positional} positional argument(s); the task has {n_inputs} input(s)")
    return source


def _validate_reply(resp: Any, *, languages: Sequence[str], n_inputs: int, seen: set[str], knob_tuning: bool) -> _Reply:
    blocks = list(getattr(resp, "content", None) or [])
    uses = [b for b in blocks if getattr(b, "type", None) == "tool_use"]
    truncated = getattr(resp, "stop_reason", None) == "max_tokens"
    if truncated:
        raise _Malformed(
            "the reply was cut off at max_tokens (truncated): send a complete but more compact file "
            "(fewer comments, no unused variants)"
        )
    if not uses:
        raise _Malformed(f"no tool call: you must call `{TOOL_NAME}` exactly once with the complete file")
    if len(uses) > 1:
        raise _Malformed(f"{len(uses)} tool calls: call `{TOOL_NAME}` exactly once, with a single file")
    use = uses[0]
    if use.name != TOOL_NAME:
        raise _Malformed(f"unknown tool {use.name!r}: call `{TOOL_NAME}`")
    inp = use.input if isinstance(use.input, dict) else {}
    language = inp.get("language")
    if not isinstance(language, str) or language.strip().lower() not in languages:
        raise _Malformed(f"`language` is {language!r}; it must be one of {list(languages)}")
    language = language.strip().lower()
    source = _check_source(inp.get("source"), n_inputs)
    if language == "triton" and "triton" not in source:
        raise _Malformed("`language` is triton but the file does not use Triton")
    if language == "pytorch" and re.search(r"@\s*triton\.jit", source):
        raise _Malformed("`language` is pytorch but the file defines Triton kernels: set language to triton")
    cid = Candidate(source=source, language=language).id
    if cid in seen:
        raise _Malformed(f"this exact file was already proposed (candidate {cid}): propose a different kernel")
    knobs: dict[str, list[Any]] = {}
    raw_knobs = inp.get("knobs")
    if knob_tuning and isinstance(raw_knobs, dict):
        for k, v in raw_knobs.items():
            if isinstance(k, str) and isinstance(v, list) and v and all(_is_literal_value(x) for x in v):
                knobs[k] = v
    return _Reply(
        source=source,
        language=language,
        conclusion=_one_line(inp.get("conclusion"), CONCLUSION_CHARS),
        rationale=_one_line(inp.get("rationale"), RATIONALE_CHARS),
        knobs=knobs,
    )


def _conclusion_of(resp: Any) -> str:
    for b in getattr(resp, "content", None) or []:
        if getattr(b, "type", None) == "tool_use" and isinstance(getattr(b, "input", None), dict):
            c = b.input.get("conclusion")
            if isinstance(c, str) and c.strip():
                return _one_line(c, CONCLUSION_CHARS)
    return ""


def _scrub(value: Any, redact: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, dict):
        return {k: _scrub(v, redact) for k, v in value.items()}
    if isinstance(value, list):
        return [_scrub(v, redact) for v in value]
    return value


def _assistant_param(resp: Any, redact: Callable[[str], str]) -> list[dict[str, Any]]:
    """The reply as an assistant turn for the repair request (secrets scrubbed, should a server echo them)."""
    out: list[dict[str, Any]] = []
    for b in getattr(resp, "content", None) or []:
        t = getattr(b, "type", None)
        if t == "text" and getattr(b, "text", "").strip():
            out.append({"type": "text", "text": redact(b.text)})
        elif t == "tool_use":
            inp = b.input if isinstance(b.input, dict) else {}
            out.append({"type": "tool_use", "id": b.id, "name": b.name, "input": _scrub(inp, redact)})
    return out or [{"type": "text", "text": "(empty reply)"}]


# ======================================================================================
# The agent
# ======================================================================================


def _zero_cost() -> dict[str, float]:
    return {k: 0 for k in COST_KEYS}


def _make_redactor(secret: str) -> Callable[[str], str]:
    pats = [re.escape(secret)] if secret else []
    pats.append(r"sk-ant-[A-Za-z0-9_\-]{6,}")
    rx = re.compile("|".join(pats))

    def redact(text: Any) -> str:
        return rx.sub("[REDACTED]", str(text))

    return redact


def _retry_after_seconds(err: Any) -> float | None:
    resp = getattr(err, "response", None)
    headers = getattr(resp, "headers", None)
    if headers is None:
        return None
    ms = headers.get("retry-after-ms")
    if ms is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    ra = headers.get("retry-after")
    if ra is None:
        return None
    try:
        return max(0.0, float(ra))
    except ValueError:
        parsed = parsedate_tz(ra)
        return None if parsed is None else max(0.0, mktime_tz(parsed) - time.time())


def _default_client_factory(
    *, api_key: str, base_url: str | None, timeout: float, max_retries: int, strict: bool, retry_cap: float
) -> Any:
    import anthropic

    class _BoundedAnthropic(anthropic.Anthropic):
        """The SDK honours retry-after without an upper bound; cap its waits."""

        def _calculate_retry_timeout(self, *args: Any, **kwargs: Any) -> float:  # type: ignore[override]
            return min(float(super()._calculate_retry_timeout(*args, **kwargs)), retry_cap)

    kwargs: dict[str, Any] = {"api_key": api_key, "timeout": timeout, "max_retries": max_retries}
    if base_url is not None:
        kwargs["base_url"] = base_url
    if strict:
        kwargs["_strict_response_validation"] = True
    return _BoundedAnthropic(**kwargs)


class AnthropicAgent:
    """An Agent whose proposals are written by Claude through the Messages API.

    Args:
        name: unique agent name in the session (e.g. ``"agent0-tiling"``).
        strategy: one of kernelarc.families.STRATEGIES.
        brief: the strategy brief text (see kernelarc.agents.briefs.load_brief).
        model: Anthropic model id.
        max_tokens: output token limit per call (non-streaming; keep it below ~21k).
        temperature: sampling temperature; None (default) sends none (the API default). The SDK's
            create() has no such parameter, so it travels as an extra body field; if the API
            refuses it (HTTP 400 naming temperature) the agent drops it and retries.
        pricing: model -> {input, output, cache_write, cache_read} in USD per million tokens.
            Missing cache prices default to 1.25x / 0.1x the input price; an unknown model costs 0
            (warned once).
        client_factory: builds the client; called with keyword arguments api_key, base_url, timeout,
            max_retries, strict, retry_cap. Default: ``anthropic.Anthropic``.
        base_url: override the API URL; default None lets the SDK honour ``ANTHROPIC_BASE_URL``.
        timeout: seconds per HTTP request.
        max_retries: the SDK's own retries per call.
        knob_tuning: ask for tunables as UPPER_CASE constants + a ``KNOBS`` literal and fill
            ``Candidate.knobs`` (hybrid tuning by the offline search agents).
        backoff_retries: our retries on top of the SDK's for 429/529/5xx/timeouts/connection errors.
        backoff_base, backoff_max: seconds; exponential with jitter, retry-after honoured but capped
            at ``backoff_max``.
        history_limit: how many of the agent's own recent attempts go into the prompt.
        languages: allowed candidate languages.
        strict_response_validation: validate API responses against the SDK schema.
        sleep: the sleep function used for backoff (tests may inject one).
    """

    # Asked again only once its candidates have verdicts (kernelarc.allot): its conclusion about an attempt
    # comes with its next proposal, and each request costs a model call, so it never proposes blind to its own.
    waits_for_verdicts = True

    def __init__(
        self,
        name: str,
        strategy: str,
        brief: str,
        model: str,
        *,
        max_tokens: int = 16_000,
        temperature: float | None = None,
        pricing: Mapping[str, Mapping[str, float]] | None = None,
        client_factory: Callable[..., Any] | None = None,
        base_url: str | None = None,
        timeout: float = 600.0,
        max_retries: int = 2,
        knob_tuning: bool = True,
        backoff_retries: int = 3,
        backoff_base: float = 2.0,
        backoff_max: float = 60.0,
        history_limit: int = 4,
        languages: Sequence[str] = LANGUAGES,
        strict_response_validation: bool = False,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        key = os.environ.get("ANTHROPIC_API_KEY", "").strip()
        if not key:
            raise AgentConfigError(
                "the anthropic agent backend needs an API key: set ANTHROPIC_API_KEY, "
                "or use agents.backend=search for the offline agents"
            )
        bad = [lang for lang in languages if lang not in LANGUAGES]
        if bad or not languages:
            raise AgentConfigError(f"languages must be a non-empty subset of {list(LANGUAGES)}; got {list(languages)}")
        self.name = name
        self.strategy = strategy
        self.brief = brief
        self.model = model
        self.max_tokens = int(max_tokens)
        self.temperature = temperature
        self.pricing = {k: dict(v) for k, v in (pricing or {}).items()}
        self.timeout = float(timeout)
        self.max_retries = int(max_retries)
        self.knob_tuning = bool(knob_tuning)
        self.backoff_retries = max(0, int(backoff_retries))
        self.backoff_base = max(0.0, float(backoff_base))
        self.backoff_max = max(0.0, float(backoff_max))
        self.history_limit = int(history_limit)
        self.languages = tuple(languages)
        self._sleep = sleep
        self._redact = _make_redactor(key)
        self._observed: deque[tuple[Candidate, Verdict]] = deque(maxlen=32)
        self._concluded: set[str] = set()
        self._warned_pricing = False
        self.total_cost: dict[str, float] = _zero_cost()
        factory = client_factory or _default_client_factory
        try:
            self._client = factory(
                api_key=key,
                base_url=base_url,
                timeout=self.timeout,
                max_retries=self.max_retries,
                strict=strict_response_validation,
                retry_cap=self.backoff_max,
            )
        except Exception as e:  # noqa: BLE001
            raise AgentConfigError(f"cannot create the Anthropic client: {self._redact(e)}") from None
        del key

    def __repr__(self) -> str:
        return f"AnthropicAgent(name={self.name!r}, strategy={self.strategy!r}, model={self.model!r})"

    __str__ = __repr__

    def close(self) -> None:
        """Close the HTTP client's connections (the agent is unusable afterwards)."""
        close = getattr(self._client, "close", None)
        if callable(close):
            close()

    # -- Agent protocol ----------------------------------------------------------------

    def observe(self, candidate: Candidate, verdict: Verdict) -> str | None:
        self._observed.append((candidate, verdict))
        return None

    def propose(self, ctx: AgentContext, n: int) -> Proposal:
        prop = Proposal(candidates=[], conclusions=[], cost=_zero_cost(), failures=[])
        if n <= 0:
            return prop
        attempts = self._attempts(ctx)
        prev = attempts[-1][0] if attempts else None
        want_conclusion = prev is not None and prev.id not in self._concluded
        seen = set(ctx.seen)
        system = build_system_blocks(
            ctx, self.brief, self.strategy, knob_tuning=self.knob_tuning, languages=self.languages
        )
        for i in range(n):
            user = build_user_prompt(
                ctx,
                attempts,
                strategy=self.strategy,
                history_limit=self.history_limit,
                this_round=prop.candidates,
                ask_conclusion=want_conclusion and i == 0,
            )
            try:
                reply = self._ask(system, user, ctx, seen, prop)
                cand = self._candidate(reply, ctx)
            except AgentConfigError:
                raise
            except _APIFailure as e:
                self._fail(prop, f"API error: {e}")
                want_conclusion = self._salvage(prop, prev, e.conclusion, want_conclusion)
                break  # the service is unwell: stop this round; the next call tries again
            except _Malformed as e:
                self._fail(prop, f"malformed reply after one repair turn: {e}")
                want_conclusion = self._salvage(prop, prev, e.conclusion, want_conclusion)
                continue
            except Exception as e:  # noqa: BLE001 - never let one bad call kill the search
                self._fail(prop, f"unexpected error: {type(e).__name__}: {e}")
                continue
            seen.add(cand.id)
            prop.candidates.append(cand)
            want_conclusion = self._salvage(prop, prev, reply.conclusion, want_conclusion)
        for k in COST_KEYS:
            self.total_cost[k] += prop.cost[k]
        log.info(
            "%s: %d candidate(s), %d failure(s), %d call(s), in %d / out %d / cache w %d r %d tokens, $%.4f",
            self.name,
            len(prop.candidates),
            len(prop.failures),
            prop.cost["calls"],
            prop.cost["input_tokens"],
            prop.cost["output_tokens"],
            prop.cost["cache_creation_input_tokens"],
            prop.cost["cache_read_input_tokens"],
            prop.cost["usd"],
        )
        return prop

    # -- internals ---------------------------------------------------------------------

    def _salvage(self, prop: Proposal, prev: Candidate | None, conclusion: str, wanted: bool) -> bool:
        """Record the conclusion about the previous attempt once; returns whether one is still wanted."""
        if wanted and prev is not None and conclusion:
            prop.conclusions.append((prev.id, _one_line(self._redact(conclusion), CONCLUSION_CHARS)))
            self._concluded.add(prev.id)
            return False
        return wanted

    def _fail(self, prop: Proposal, msg: str) -> None:
        text = _one_line(self._redact(f"{self.name}: {msg}"), 600)
        prop.failures.append(text)
        log.warning("%s", text)

    def _attempts(self, ctx: AgentContext) -> list[tuple[Candidate, Verdict]]:
        """This agent's attempts: ctx.history, plus observed verdicts it does not hold yet."""
        out = list(ctx.history or [])
        ids = {c.id for c, _ in out}
        out.extend((c, v) for c, v in self._observed if c.id not in ids)
        return out

    def _candidate(self, reply: _Reply, ctx: AgentContext) -> Candidate:
        source = self._redact(reply.source)  # a key never leaves the agent, even if a server echoes it
        knobs: dict[str, Any] = {}
        if self.knob_tuning:
            space = knob_space_of(source)
            if not space and reply.knobs:
                try:
                    probe = _insert_knobs_literal(source, reply.knobs)
                except (SyntaxError, ValueError):
                    probe = source
                declared = knob_space_of(probe)
                if declared:
                    source = _insert_knobs_literal(source, {k: reply.knobs[k] for k in declared})
                dropped = sorted(set(reply.knobs) - set(declared))
                if dropped:
                    log.info("%s: knobs %s dropped (no single module-level literal constant)", self.name, dropped)
            knobs = knob_values_of(source)
        return Candidate(
            source=source,
            language=reply.language,
            agent=self.name,
            strategy=self.strategy,
            family=None,
            knobs=knobs,
            parent=ctx.champion.id if ctx.champion is not None else None,
            rationale=self._redact(reply.rationale),
        )

    def _ask(
        self, system: list[dict[str, Any]], user: str, ctx: AgentContext, seen: set[str], prop: Proposal
    ) -> _Reply:
        messages: list[dict[str, Any]] = [{"role": "user", "content": user}]
        check = dict(
            languages=self.languages,
            n_inputs=len(ctx.task.definition.inputs),
            seen=seen,
            knob_tuning=self.knob_tuning,
        )
        resp = self._call(system, messages, prop)
        conclusion = _conclusion_of(resp)
        try:
            return _validate_reply(resp, **check)
        except _Malformed as e:
            first = str(e)
            log.info("%s: malformed reply (%s); one repair turn", self.name, self._redact(first))
        messages.append({"role": "assistant", "content": _assistant_param(resp, self._redact)})
        note = f"Your reply was rejected: {first}. Call `{TOOL_NAME}` exactly once with one complete, corrected file."
        uses = [b for b in messages[-1]["content"] if b["type"] == "tool_use"]
        if uses:
            content: list[dict[str, Any]] = [
                {"type": "tool_result", "tool_use_id": b["id"], "content": note, "is_error": True} for b in uses
            ]
        else:
            content = [{"type": "text", "text": note}]
        messages.append({"role": "user", "content": content})
        try:
            resp = self._call(system, messages, prop)
            conclusion = _conclusion_of(resp) or conclusion
            return _validate_reply(resp, **check)
        except (_Malformed, _APIFailure) as e:  # recorded by propose, with any conclusion salvaged
            e.conclusion = conclusion
            raise

    def _call(self, system: list[dict[str, Any]], messages: list[dict[str, Any]], prop: Proposal) -> Any:
        import anthropic

        kwargs: dict[str, Any] = {
            "model": self.model,
            "max_tokens": self.max_tokens,
            "system": system,
            "messages": messages,
            "tools": [submit_tool(self.languages, self.knob_tuning)],
            "tool_choice": {"type": "tool", "name": TOOL_NAME, "disable_parallel_tool_use": True},
            "timeout": self.timeout,
        }
        attempts = self.backoff_retries + 1
        attempt = 0
        while True:
            if self.temperature is not None:
                # anthropic 2.x's create() has no temperature parameter: send it as an extra field
                kwargs["extra_body"] = {"temperature": self.temperature}
            else:
                kwargs.pop("extra_body", None)
            try:
                resp = self._client.messages.create(**kwargs)
            except anthropic.AuthenticationError as e:
                detail = self._redact(getattr(e, "api_message", None) or "authentication_error")
                raise AgentConfigError(
                    f"the Anthropic API rejected the API key (HTTP 401: {_one_line(detail, 200)}); "
                    "set a valid ANTHROPIC_API_KEY, or use agents.backend=search for the offline agents"
                ) from None
            except anthropic.APIStatusError as e:
                status = getattr(e, "status_code", 0) or 0
                what = f"HTTP {status} {getattr(e, 'type', None) or type(e).__name__}: " + _one_line(
                    getattr(e, "api_message", None) or "", 200
                )
                if status == 400 and self.temperature is not None and "temperature" in what.lower():
                    log.warning(
                        "%s: the API refuses `temperature` for %s; sending none from now on", self.name, self.model
                    )
                    self.temperature = None
                    continue  # at once, without counting an attempt (happens at most once)
                if not (status in (408, 409, 429) or status >= 500):
                    raise _APIFailure(self._redact(what)) from None
                wait = _retry_after_seconds(e)
            except (anthropic.APITimeoutError, anthropic.APIConnectionError) as e:
                what = f"{type(e).__name__}: {_one_line(e, 200)}"
                wait = None
            except anthropic.APIResponseValidationError as e:
                raise _APIFailure(self._redact(f"invalid API response: {_one_line(e, 300)}")) from None
            else:
                self._account(resp, prop)
                return resp
            if attempt >= attempts - 1:
                raise _APIFailure(self._redact(f"{what} (after {attempts} attempt(s))"))
            delay = self._backoff(attempt, wait)
            log.warning("%s: %s; retrying in %.2f s", self.name, self._redact(what), delay)
            self._sleep(delay)
            attempt += 1

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        if retry_after is not None:
            return min(self.backoff_max, retry_after * (1 + 0.1 * random.random()))
        return min(self.backoff_max, self.backoff_base * (2**attempt)) * (0.5 + 0.5 * random.random())

    def _price(self) -> Mapping[str, float] | None:
        if self.model in self.pricing:
            return self.pricing[self.model]
        best = max((k for k in self.pricing if self.model.startswith(k)), key=len, default=None)
        return self.pricing[best] if best else None

    def _account(self, resp: Any, prop: Proposal) -> None:
        u = getattr(resp, "usage", None)
        counts = {
            k: int(getattr(u, k, 0) or 0)
            for k in ("input_tokens", "output_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")
        }
        price = self._price()
        usd = 0.0
        if price is None:
            if not self._warned_pricing and self.pricing is not None:
                log.warning("%s: no pricing for model %r; its cost is counted as $0", self.name, self.model)
                self._warned_pricing = True
        else:
            pin = float(price.get("input", 0.0))
            usd = (
                counts["input_tokens"] * pin
                + counts["output_tokens"] * float(price.get("output", 0.0))
                + counts["cache_creation_input_tokens"] * float(price.get("cache_write", 1.25 * pin))
                + counts["cache_read_input_tokens"] * float(price.get("cache_read", 0.1 * pin))
            ) / 1e6
        for k, v in counts.items():
            prop.cost[k] += v
        prop.cost["usd"] += usd
        prop.cost["calls"] += 1
