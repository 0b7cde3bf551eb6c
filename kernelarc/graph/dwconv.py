"""Depthwise 1-D convolutions with what reads them, as one generated Triton kernel per site.

A *site* is a ``conv1d`` / ``convolution`` over ``x`` [B, C, L] with one filter per channel (``groups == C``,
weight [C, 1, K], stride 1, any padding and dilation, bias or none): the short convolution of Hyena, Mamba and
other state-space blocks. It takes with it:

* a window of the output along time (``y[..., :L]``: a causal convolution written as padding then a trim);
* the channel slices read from it (``y[:, :d]``, ``y[:, d:2 * d]``, ``torch.split``): all of one width ``n``;
* the pointwise ops over those slices, of their shape (a gate ``v * x0``, Mamba's SiLU, casts).

One kernel computes every slice a program needs from ``x`` (K shifted loads per slice, fp32 sums starting from the
bias), the pointwise ops in registers, and stores only the values read outside the site, each contiguous
[B, n, L']. Eager PyTorch writes the whole convolution output (its padded length included) and reads it back for
each op after it; Inductor calls the convolution as an extern kernel and fuses only what follows.

Each op's result is rounded to its dtype as the reference's eager op rounds it (the convolution's output too);
the pointwise codegen is the fused regions' (``kernelarc.graph.fusion``)."""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
from torch.fx import Node

from kernelarc.graph.capture import depends_on, node_dtype, node_shape, static_int
from kernelarc.graph.fusion import FLOATS, LOW, TANH_JIT, Region, Role, _pointwise_ok, _same, _Writer, stored
from kernelarc.graph.patterns import Kind, Site, arg, mutation_between, op

FAMILY = "dwconv.tiled"
_SPLITS = ("split", "split_with_sizes", "chunk")  # channel cuts with items (getitem) besides ``slice``
MAX_K = 64  # filter taps unrolled in the kernel


@dataclass
class DwConv:
    """One site: the convolution's geometry, its channel slices (channel offsets, one width), the pointwise ops over
    them in graph order and the values stored."""

    conv: Node
    channels: int
    taps: int
    pad_left: int
    pad_right: int
    dilation: int
    t0: int  # the time window kept: [t0, t1) of the convolution's output
    t1: int | str | None  # an int, "L" (the input's length), None (to the end); negative ints count from the end
    width: int  # channels per slice (== channels when the output is read whole)
    slices: dict[Node, int]  # node -> first channel
    nodes: list[Node]  # the pointwise ops, graph order
    outputs: list[Node]  # site values read outside it, graph order
    covered: set[Node] = field(default_factory=set)
    dtype: torch.dtype = torch.float32
    # tensors from outside the site the pointwise ops read: "full" (the slices' shape), "channel" (one value per
    # channel of a slice), "scalar"; each loaded in the kernel through its strides
    extras: list[tuple[Node, str]] = field(default_factory=list)

    @property
    def has_bias(self) -> bool:
        return arg(self.conv, 2, "bias") is not None

    def describe(self) -> str:
        offs = sorted(set(self.slices.values()))
        return (f"depthwise conv1d C={self.channels} K={self.taps} pad=({self.pad_left}, {self.pad_right}) "
                f"dilation={self.dilation}, {len(offs)} slice(s) of {self.width} channels at {offs}, "
                f"{len(self.nodes)} pointwise op(s), {len(self.outputs)} output(s)")  # fmt: skip


def _ints(v: Any, n: int = 1) -> list[int] | None:
    """``[a]`` / ``a`` as a list of ``n`` Python ints (None for anything else)."""
    vals = list(v) if isinstance(v, list | tuple) else [v] * n
    if len(vals) != n or not all(isinstance(a, int) and not isinstance(a, bool) for a in vals):
        return None
    return vals


def _fixed(d: Any) -> int | None:
    """A dimension's value where tracing fixed it (no hint of a free symbol)."""
    v = static_int(d)
    return v if v is not None or not isinstance(d, torch.SymInt) else d.node.maybe_as_int()


def _size(x: Any) -> int | None:
    """A dimension's value: fixed by tracing, else the traced example's (``run`` checks the shape it was generated
    for, and declines any other)."""
    v = _fixed(x)
    if v is None and isinstance(x, torch.SymInt) and x.node.has_hint():
        v = int(x.node.hint)
    return v


def _same_shape(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(_same(p, q) for p, q in zip(a, b, strict=True))


def _conv(n: Node) -> tuple[int, int, int, int, int] | None:
    """(channels, taps, pad_left, pad_right, dilation) of a depthwise 1-D convolution node (None: another op)."""
    name = op(n)
    if name not in ("conv1d", "convolution"):
        return None
    x, w = n.args[0], n.args[1]
    if not isinstance(x, Node) or not isinstance(w, Node):
        return None
    xs, ws = node_shape(x), node_shape(w)
    if xs is None or ws is None or len(xs) != 3 or len(ws) != 3:
        return None
    c, one, k = (_size(v) for v in ws)
    if c is None or k is None or one != 1 or _size(xs[1]) != c or not 1 <= k <= MAX_K:
        return None
    stride, padding, dilation = arg(n, 3, "stride", [1]), arg(n, 4, "padding", [0]), arg(n, 5, "dilation", [1])
    if name == "convolution":
        if arg(n, 6, "transposed", False) or any(p != 0 for p in (_ints(arg(n, 7, "output_padding", [0])) or [1])):
            return None
        groups = arg(n, 8, "groups", 1)
    else:
        groups = arg(n, 6, "groups", 1)
    if groups != c or _ints(stride) != [1] or (dil := _ints(dilation)) is None or dil[0] < 1:
        return None
    d = dil[0]
    if padding == "valid":
        left = right = 0
    elif padding == "same":  # torch pads the odd element on the right
        left = d * (k - 1) // 2
        right = d * (k - 1) - left
    elif (p := _ints(padding)) is not None and p[0] >= 0:
        left = right = p[0]
    else:
        return None
    b = arg(n, 2, "bias")
    dts = {node_dtype(x), node_dtype(w), node_dtype(n)} | ({node_dtype(b)} if isinstance(b, Node) else set())
    if (b is not None and not isinstance(b, Node)) or len(dts) != 1 or node_dtype(n) not in FLOATS:
        return None
    return c, k, left, right, d


def _slice_args(n: Node) -> tuple[int, Any, Any] | None:
    """(dim, start, end) of a step-1 ``slice`` node."""
    if op(n) != "slice" or arg(n, 4, "step", 1) != 1:
        return None
    return arg(n, 1, "dim", 0), arg(n, 2, "start"), arg(n, 3, "end")


def _input_length(end: Any, x: Node) -> bool:
    """``end`` is ``x.shape[-1]`` read in the graph (a symbolic trace)."""
    return op(end) == "sym_size" and end.args[0] is x and end.args[1] in (2, -1)


def _time_window(conv: Node) -> tuple[Node, int, int | str | None] | None:
    """The value the channel slices read (the convolution, or a window of it along time) and the window."""
    users = list(conv.users)
    if len(users) == 1 and (s := _slice_args(users[0])) is not None and s[0] in (2, -1):
        start, end = s[1], s[2]
        start = 0 if start is None else start
        if not isinstance(start, int) or start < 0:
            return None
        if isinstance(end, Node):
            if not _input_length(end, conv.args[0]):
                return None
            end = "L"
        elif end is not None and not isinstance(end, int):
            return None
        elif end is not None and end == _fixed(node_shape(conv.args[0])[2]):
            end = "L"  # the traced length as a literal: the same kernel for every length (the case holds it)
        return users[0], start, end
    return conv, 0, None


def _split_sizes(u: Node, channels: int) -> list[int] | None:
    """The channel counts of a ``split`` / ``split_with_sizes`` / ``chunk`` along dim 1 (None: another form)."""
    name = op(u)
    if arg(u, 2, "dim", 0) not in (1, -2):
        return None
    size = u.args[1] if len(u.args) > 1 else None
    if name in ("split", "chunk") and isinstance(size, int) and not isinstance(size, bool) and size > 0:
        each = size if name == "split" else -(-channels // size)
        return [each] * (channels // each) + ([channels % each] if channels % each else [])
    if name == "split_with_sizes" and isinstance(size, list | tuple) and (sizes := _ints(size, len(size))):
        return sizes if sum(sizes) == channels and min(sizes) > 0 else None
    return None


def _channel_slices(v: Node, channels: int) -> tuple[dict[Node, int], int, set[Node]] | None:
    """The slices of ``v`` along the channels ({node: first channel}, their width, the split nodes between): every
    reader of ``v`` a ``slice`` of dim 1, or a ``split`` / ``split_with_sizes`` / ``chunk`` along dim 1 and its
    items; ``v`` itself (width ``channels``) when no reader slices it."""
    users = list(v.users)
    if not users:
        return None
    if not any(op(u) == "slice" or op(u) in _SPLITS for u in users):  # read whole: by pointwise ops, or outside
        return {v: 0}, channels, set()
    starts: dict[Node, int] = {}
    widths: set[int] = set()
    between: set[Node] = set()
    for u in users:
        name = op(u)
        if name == "slice":
            s = _slice_args(u)
            if s is None or s[0] not in (1, -2):
                return None
            start = 0 if s[1] is None else s[1]
            end = channels if s[2] is None else s[2]
            if not isinstance(start, int) or not isinstance(end, int) or not 0 <= start < min(end, channels):
                return None
            starts[u] = start
            widths.add(min(end, channels) - start)
        elif name in _SPLITS:
            sizes = _split_sizes(u, channels)
            if sizes is None:
                return None
            between.add(u)
            for g in u.users:
                if g.op != "call_function" or g.target is not operator.getitem or not isinstance(g.args[1], int):
                    return None
                starts[g] = sum(sizes[: g.args[1]])
                widths.add(sizes[g.args[1]])
        else:  # the whole value read next to its slices
            return None
    if len(widths) != 1:
        return None
    return starts, widths.pop(), between


def _extra_role(a: Node, shape: tuple, width: int) -> str | None:
    """How the pointwise ops read a tensor from outside the site (None: not a way the kernel loads)."""
    s = node_shape(a)
    if s is None or node_dtype(a) not in FLOATS or len(s) > 3:
        return None
    if _same_shape(s, shape):
        return "full"
    pad = (1,) * (3 - len(s)) + tuple(s)
    if all(_fixed(d) == 1 for d in pad):
        return "scalar"
    if _fixed(pad[0]) == 1 and _fixed(pad[2]) == 1 and _fixed(pad[1]) == width:
        return "channel"
    return None


def _epilogue(slices: dict[Node, int], shape: tuple, width: int, conv: Node, taken: set[Node],
              order: dict[Node, int]) -> tuple[list[Node], list[tuple[Node, str]]]:  # fmt: skip
    """Pointwise ops of the slices' shape whose tensor operands are slices, such ops, or tensors from outside the
    site the kernel can load (``_extra_role``, not computed from the convolution), grown to a fixed point, in graph
    order; and those outside tensors in first-use order."""
    inside: set[Node] = set(slices)
    extras: dict[Node, str] = {}
    cache: dict[Node, bool] = {}
    added = True
    while added:
        added = False
        for n in list(inside):
            for u in n.users:
                if u in inside or u in taken or u.op != "call_function" or not _pointwise_ok(u):
                    continue
                if not _same_shape(node_shape(u), shape):
                    continue
                new: dict[Node, str] = {}
                for a in u.all_input_nodes:
                    if a in inside:
                        continue
                    role = extras.get(a) or _extra_role(a, shape, width)
                    if role is None or a in taken or depends_on(a, conv, cache):
                        new = {}
                        break
                    new[a] = role
                else:
                    inside.add(u)
                    extras.update(new)
                    added = True
    nodes = sorted(inside - set(slices), key=order.__getitem__)
    first = {}
    for n in nodes:
        for a in n.all_input_nodes:
            if a in extras and a not in first:
                first[a] = extras[a]
    return nodes, list(first.items())


def find_dwconv(conv: Node, taken: set[Node]) -> DwConv | None:
    geom = _conv(conv)
    if geom is None or conv in taken:
        return None
    c, k, left, right, d = geom
    window = _time_window(conv)
    if window is None:
        return None
    v, t0, t1 = window
    found = _channel_slices(v, c)
    if found is None:
        return None
    slices, width, between = found
    shape = node_shape(next(iter(slices)))
    if not all(_same_shape(node_shape(s), shape) for s in slices) or any(s in taken for s in slices):
        return None
    order = {n: i for i, n in enumerate(conv.graph.nodes)}
    epi, extras = _epilogue(slices, shape, width, conv, taken, order)
    covered = {conv, v, *between, *slices, *epi}
    outputs = sorted((n for n in (*slices, *epi) if any(u not in covered for u in n.users)), key=order.__getitem__)
    if not outputs or any(node_dtype(n) not in FLOATS for n in outputs):
        return None
    for n in covered - set(outputs):
        if any(u not in covered for u in n.users):
            return None
    if covered & taken or mutation_between(conv, outputs[-1], covered):
        return None
    return DwConv(conv, c, k, left, right, d, t0, t1, width, slices, epi, outputs, covered, node_dtype(conv), extras)


def dwconv_sites(gm: torch.fx.GraphModule, taken: set[Node]) -> list[Site]:
    out: list[Site] = []
    seen = set(taken)
    for n in gm.graph.nodes:
        if op(n) not in ("conv1d", "convolution"):
            continue
        plan = find_dwconv(n, seen)
        if plan is None:
            continue
        last = plan.outputs[-1]
        extra = {f"out{i}": m for i, m in enumerate(plan.outputs) if m is not last}
        inputs = {"x": n.args[0], "weight": n.args[1], "bias": arg(n, 2, "bias"),
                  **{f"extra{i}": e for i, (e, _) in enumerate(plan.extras)}}  # fmt: skip
        params = {"channels": plan.channels, "taps": plan.taps, "width": plan.width, "slices": len(set(
                  plan.slices.values())), "ops": len(plan.nodes), "dtype": str(plan.dtype).removeprefix("torch."),
                  "_plan": plan}  # fmt: skip
        out.append(Site(Kind.dwconv, last, plan.covered, inputs, params, extra))
        seen |= plan.covered
    return out


# ------------------------------------------------------------------------------------------
# code generation


def _window_lines(plan: DwConv) -> list[str]:
    """``run``'s lines for the kept window's length ``LO`` (the convolution's length ``LOUT``; the window starts at
    ``plan.t0``, a literal of the kernel: its shifted loads at offsets known when it compiles)."""
    lines = [f"LOUT = L + {plan.pad_left + plan.pad_right} - {plan.dilation * (plan.taps - 1)}"]
    t1 = plan.t1
    if t1 is None:
        end = "LOUT"
    elif t1 == "L":
        end = "min(L, LOUT)"
    elif isinstance(t1, int) and t1 < 0:
        end = f"max(LOUT + {t1}, 0)"
    else:
        end = f"min({t1}, LOUT)"
    lines.append(f"LO = max({end} - {plan.t0}, 0)")
    return lines


def render_dwconv(plan: DwConv, knobs: dict[str, Any], doc: str) -> str:
    """A candidate module part computing the site: ``run(x, weight, bias, *extras)`` returns its outputs in
    ``plan.outputs`` order, or None for inputs the kernel does not serve (the caller then runs the site's own
    ops)."""
    from kernelarc.families import _mem_common as mc

    offsets = sorted(set(plan.slices.values()))
    w = _Writer(Region(rank=3, H=None, nodes=plan.nodes, roles={n: Role.full for n in plan.nodes}))
    conv_lines: list[str] = []
    low = LOW.get(plan.dtype)
    for i, off in enumerate(offsets):
        conv_lines += [
            f"ch = (ci + {off}).to(tl.int64)",
            "xr = (xb + ch * sxc)[:, None]",
            "wr = w_ptr + ch * swc",
            f"s{i} = {'tl.load(b_ptr + ch * sb, mask=rm, other=0).to(tl.float32)[:, None] + ' if plan.has_bias else ''}"
            "tl.zeros([BLOCK_R, BLOCK_L], tl.float32)",
            f"for k in tl.static_range({plan.taps}):",
            f"    t = cols + ({plan.t0 - plan.pad_left} + k * {plan.dilation})",
            "    tm = m & ((t >= 0) & (t < L))[None, :]",
            "    wk = tl.load(wr + k * swk, mask=rm, other=0).to(tl.float32)[:, None]",
            f"    s{i} += tl.load(x_ptr + xr + t.to(tl.int64)[None, :] * sxt, mask=tm, other=0).to(tl.float32) * wk",
        ]
        if low:
            conv_lines.append(f"s{i} = _cast_out(s{i}, {low}).to(tl.float32)")
        for s, o in plan.slices.items():
            if o == off:
                w.names[s] = f"s{i}"
    extra_params: list[str] = []
    extra_args: list[str] = []
    extra_checks: list[str] = []
    for i, (e, role) in enumerate(plan.extras):
        extra_params.append(f"e{i}")
        w.names[e] = f"e{i}v"
        if role == "full":
            extra_params += [f"se{i}a", f"se{i}b", f"se{i}c"]
            extra_args += [f"e{i}", f"e{i}.stride(0)", f"e{i}.stride(1)", f"e{i}.stride(2)"]
            extra_checks.append(f"tuple(e{i}.shape) != (B, {plan.width}, LO)")
            conv_lines.append(f"e{i}v = tl.load(e{i} + bi[:, None] * se{i}a + ci64[:, None] * se{i}b + cols64 * se{i}c"
                              ", mask=m, other=0).to(tl.float32)")  # fmt: skip
        elif role == "channel":
            extra_params.append(f"se{i}")
            extra_args += [f"e{i}", f"e{i}.reshape({plan.width}).stride(0)"]
            extra_checks.append(f"e{i}.numel() != {plan.width} or e{i}.dim() > 3")
            conv_lines.append(f"e{i}v = tl.load(e{i} + ci64 * se{i}, mask=rm, other=0).to(tl.float32)[:, None]")
        else:
            extra_args.append(f"e{i}")
            extra_checks.append(f"e{i}.numel() != 1 or e{i}.dim() > 3")
            conv_lines.append(f"e{i}v = tl.load(e{i}).to(tl.float32)")
        extra_checks.append(f"e{i}.dtype != {node_dtype(e)} or e{i}.device != x.device")
    for j, n in enumerate(plan.nodes):
        w.node(j, n)
    stores = [f"tl.store(o{q} + rows64 * LO + cols64, {stored(n, w.names[n])}, mask=m)"
              for q, n in enumerate(plan.outputs)]  # fmt: skip
    outs = [(f"o{q}", node_dtype(n)) for q, n in enumerate(plan.outputs)]
    params = ["x_ptr", "w_ptr", "b_ptr", *[o for o, _ in outs], *extra_params, "R", "L", "LO", "sxb", "sxc", "sxt",
              "swc", "swk", "sb", "BLOCK_R: tl.constexpr", "BLOCK_L: tl.constexpr"]  # fmt: skip
    kernel = [
        *TANH_JIT,
        "",
        "",
        "@triton.jit",
        f"def _dwconv_kernel({', '.join(params)}):",
        "    pid = tl.program_id(0)",  # one grid axis (2**31 - 1 programs): rows outer, time tiles inner
        "    NL = tl.cdiv(LO, BLOCK_L)",
        "    rows = (pid // NL) * BLOCK_R + tl.arange(0, BLOCK_R)",
        "    cols = (pid % NL) * BLOCK_L + tl.arange(0, BLOCK_L)",
        "    rm = rows < R",
        "    m = rm[:, None] & (cols < LO)[None, :]",
        f"    ci = rows % {plan.width}",
        "    ci64 = ci.to(tl.int64)",
        f"    bi = (rows // {plan.width}).to(tl.int64)",
        "    xb = bi * sxb",
        "    rows64 = rows.to(tl.int64)[:, None]",
        "    cols64 = cols.to(tl.int64)[None, :]",
        *["    " + ln for ln in conv_lines],
        *["    " + ln for ln in w.body],
        *["    " + ln for ln in stores],
    ]
    c, k = plan.channels, plan.taps
    dt = str(plan.dtype)
    bias_ok = (f" and b is not None and tuple(b.shape) == ({c},) and b.dtype == {dt}" if plan.has_bias
               else " and b is None")  # fmt: skip
    run = [
        f"def run(x, w, b{''.join(f', e{i}' for i in range(len(plan.extras)))}):",
        f"    if not (x.dim() == 3 and x.shape[1] == {c} and tuple(w.shape) == ({c}, 1, {k}) and x.dtype == {dt}"
        f" and w.dtype == {dt}{bias_ok}):",
        "        return None",
        "    B, _, L = x.shape",
        *["    " + ln for ln in _window_lines(plan)],
        f"    R = B * {plan.width}",
        f"    if R == 0 or LO == 0 or x.device != w.device{' or b.device != x.device' if plan.has_bias else ''}:",
        "        return None",
        *[ln for chk in extra_checks for ln in (f"    if {chk}:", "        return None")],
        *[f"    {o} = torch.empty((B, {plan.width}, LO), dtype={d}, device=x.device)" for o, d in outs],
        "    br, bl = BLOCK_R, BLOCK_L",
        "    if INTERPRET:  # the interpreter runs a program at a time: few large tiles (the same values)",
        "        br, bl = max(br, 64), max(bl, min(triton.next_power_of_2(LO), 4096))",
        "    grid = (triton.cdiv(R, br) * triton.cdiv(LO, bl),)",
        f"    _dwconv_kernel[grid](x, w, {'b' if plan.has_bias else 'w'}, {', '.join(o for o, _ in outs)}, "
        f"{''.join(a + ', ' for a in extra_args)}R, L, LO, "
        "x.stride(0), x.stride(1), x.stride(2), w.stride(0), w.stride(2), "
        f"{'b.stride(0)' if plan.has_bias else '0'}, BLOCK_R=br, BLOCK_L=bl, num_warps=NUM_WARPS)",
        f"    return ({', '.join(o for o, _ in outs)},)",
    ]
    head = mc.header(FAMILY, f"{doc}: {plan.describe()}", knobs)
    consts = "\n".join(f"{n} = {knobs[n]!r}" for n in ("BLOCK_R", "BLOCK_L", "NUM_WARPS"))
    return head + "\n" + consts + "\n\n\n" + "\n".join(kernel) + "\n\n\n" + "\n".join(run) + "\n"


__all__ = ["FAMILY", "DwConv", "dwconv_sites", "find_dwconv", "render_dwconv"]
