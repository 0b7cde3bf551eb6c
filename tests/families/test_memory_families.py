"""CPU tests of the memory-bound families (rmsnorm, fused_add_rmsnorm, softmax, swiglu, rope).

Every family: its start point and a few other valid points are rendered, loaded as
modules and run under Triton's interpreter against a float64 reference on fresh random
inputs, with odd shapes that exercise masking and the chunked / fallback paths. Each
family's start point is also compiled ahead of time for sm_90a (no GPU needed), at the
GPU workload shapes, as a gate that it builds for Hopper.
"""

import os
import sys

if not (__name__ == "__main__" and "--aot" in sys.argv):
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported anywhere

import importlib.util
import math
import random
import traceback
import zlib

import pytest
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from kernelarc.families import families_for

# The interpreter converts 1-element arrays to loop bounds (numpy deprecation noise);
# masked-off rows divide by zero in lanes that are never stored.
pytestmark = [
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
]

TASKS = ("rmsnorm", "fused_add_rmsnorm", "softmax", "swiglu", "rope")

# ---------------------------------------------------------------------------------
# tasks: inputs, float64 references, shapes


def _rand(gen, shape, scale=1.0, dtype=torch.bfloat16):
    x = torch.randn(shape, generator=gen, dtype=torch.float32) * scale
    return x.to(dtype)


def _weight(gen, n):
    w = torch.rand(n, generator=gen) + 0.5
    sign = torch.where(torch.rand(n, generator=gen) < 0.2, -1.0, 1.0)
    return (w * sign).to(torch.bfloat16)


def _inputs(task, shape, gen):
    if task == "rmsnorm":
        m, n = shape
        return (_rand(gen, (m, n), 1.5), _weight(gen, n))
    if task == "fused_add_rmsnorm":
        m, n = shape
        return (_rand(gen, (m, n), 1.5), _rand(gen, (m, n), 0.7), _weight(gen, n))
    if task == "softmax":
        m, n = shape
        return (_rand(gen, (m, n), 3.0),)
    if task == "swiglu":
        m, n = shape
        return (_rand(gen, (m, 2 * n), 2.0),)
    if task == "rope":
        t, h, hkv, d = shape
        pos = torch.arange(t, dtype=torch.float64)[:, None] + 3.0
        inv = 10000.0 ** (-torch.arange(d // 2, dtype=torch.float64) / (d // 2))
        ang = pos * inv[None, :]
        return (
            _rand(gen, (t, h, d)),
            _rand(gen, (t, hkv, d)),
            ang.cos().float().contiguous(),
            ang.sin().float().contiguous(),
        )
    raise KeyError(task)


def _reference(task, inputs):
    f = [t.double() for t in inputs]
    if task == "rmsnorm":
        x, w = f
        return (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w,)
    if task == "fused_add_rmsnorm":
        x, r, w = f
        s = x + r
        return (s * torch.rsqrt((s * s).mean(-1, keepdim=True) + 1e-6) * w, s)
    if task == "softmax":
        return (torch.softmax(f[0], dim=-1),)
    if task == "swiglu":
        (x,) = f
        n = x.shape[1] // 2
        g, u = x[:, :n], x[:, n:]
        return (g * torch.sigmoid(g) * u,)
    if task == "rope":
        q, k, cos, sin = f
        outs = []
        for t in (q, k):
            h = t.shape[-1] // 2
            x1, x2 = t[..., :h], t[..., h:]
            c, s = cos[:, None, :], sin[:, None, :]
            outs.append(torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))
        return tuple(outs)
    raise KeyError(task)


# (atol, rtol) against the float64 reference; outputs are bf16 (2^-8 relative rounding).
TOL = {
    "rmsnorm": (1e-2, 1.6e-2),
    "fused_add_rmsnorm": (1e-2, 1.6e-2),
    "softmax": (2e-5, 1.6e-2),
    "swiglu": (1e-2, 1.6e-2),
    "rope": (1e-2, 1.6e-2),
}

# CPU shapes: the task's own small ones plus odd ones (N not a power of two, long rows
# that force chunked loops and fallbacks, a single row).
CPU_SHAPES = {
    "rmsnorm": [(8, 64), (5, 100), (3, 600), (1, 37)],
    "fused_add_rmsnorm": [(8, 64), (5, 100), (3, 600), (1, 37)],
    "softmax": [(6, 50), (4, 300), (3, 700), (1, 37)],
    "swiglu": [(5, 24), (3, 70), (4, 300)],
    "rope": [(7, 2, 1, 16), (5, 3, 2, 24), (9, 5, 1, 8)],
}

# GPU workload shapes (compiled ahead of time only).
GPU_SHAPES = {
    "rmsnorm": [(32768, 4096), (16384, 8192), (4096, 2048)],
    "fused_add_rmsnorm": [(32768, 4096), (16384, 8192), (4096, 2048)],
    "softmax": [(8192, 4096), (4096, 32768), (65536, 1024)],
    "swiglu": [(8192, 14336), (16384, 4096)],
    "rope": [(16384, 32, 8, 128), (65536, 8, 2, 64)],
}


def _meta_inputs(task, shape):
    bf = dict(dtype=torch.bfloat16, device="meta")
    if task == "rmsnorm":
        m, n = shape
        return (torch.empty((m, n), **bf), torch.empty((n,), **bf))
    if task == "fused_add_rmsnorm":
        m, n = shape
        return (torch.empty((m, n), **bf), torch.empty((m, n), **bf), torch.empty((n,), **bf))
    if task == "softmax":
        return (torch.empty(shape, **bf),)
    if task == "swiglu":
        m, n = shape
        return (torch.empty((m, 2 * n), **bf),)
    if task == "rope":
        t, h, hkv, d = shape
        f32 = dict(dtype=torch.float32, device="meta")
        return (
            torch.empty((t, h, d), **bf),
            torch.empty((t, hkv, d), **bf),
            torch.empty((t, d // 2), **f32),
            torch.empty((t, d // 2), **f32),
        )
    raise KeyError(task)


# ---------------------------------------------------------------------------------
# points to exercise per family, beyond the start point (overrides of start)

POINTS = {
    "rmsnorm.rowblock": [
        dict(rows=4, num_warps=2, persistent=2, num_stages=2, x_load="evict_first", store_cache=".cs"),
        # tiny register budget: N=600 > 16*32*1 takes the chunked fallback
        dict(max_elems_per_thread=16, num_warps=1, rows=2, rsqrt="rsqrt", w_evict="evict_last"),
        dict(rows=32, num_warps=8, x_load="cg", persistent=1, num_stages=3),
        # long rows keep the whole-row kernel with more warps (N=700 on the CPU: 2 warps; 4096 on the GPU: 8)
        dict(max_elems_per_thread=16, num_warps=1, rows=2, long_rows="more_warps"),
    ],
    "rmsnorm.chunked": [
        dict(block_n=128, rows=2, num_warps=1, num_stages=2, pass1_evict="evict_last", pass2_evict="evict_first"),
        dict(block_n=256, rows=4, num_warps=4, persistent=4, rsqrt="rsqrt", store_cache=".cs", reduce="chunk"),
        dict(block_n=4096, num_warps=8, persistent=1, num_stages=3),
    ],
    "fused_add_rmsnorm.rowblock": [
        dict(rows=4, num_warps=2, persistent=2, num_stages=2, residual_store="early", x_load="evict_first"),
        dict(max_elems_per_thread=16, num_warps=1, rows=2, rsqrt="rsqrt", store_cache=".cs"),
        dict(rows=16, num_warps=8, x_load="cg", w_evict="evict_last", persistent=1),
        # long rows keep the whole-row kernel with more warps (N=700 on the CPU: 2 warps; 4096 on the GPU: 8)
        dict(max_elems_per_thread=16, num_warps=1, rows=2, long_rows="more_warps"),
    ],
    "fused_add_rmsnorm.chunked": [
        dict(block_n=128, rows=2, num_warps=1, second_pass="residual_out", pass1_evict="evict_last"),
        dict(block_n=256, rows=4, num_warps=4, persistent=4, num_stages=2, rsqrt="rsqrt", reduce="chunk"),
        dict(block_n=2048, num_warps=8, persistent=1, second_pass="residual_out", pass2_evict="evict_first"),
    ],
    "softmax.rowblock": [
        dict(rows=4, num_warps=2, persistent=2, num_stages=2, x_load="evict_first", normalize="mul_rcp"),
        # N=300/700 > 16*32*1 takes the online fallback
        dict(max_elems_per_thread=16, num_warps=1, rows=2, normalize="div", store_cache=".cs"),
        dict(rows=32, num_warps=8, x_load="cg", persistent=1, num_stages=3),
        # long rows keep the whole-row kernel with more warps (N=700 on the CPU: 2 warps; 4096 on the GPU: 8)
        dict(max_elems_per_thread=16, num_warps=1, rows=2, long_rows="more_warps"),
    ],
    "softmax.online": [
        dict(block_n=128, rows=2, num_warps=1, online_mode="lanewise", pass1_evict="evict_last"),
        dict(
            block_n=256,
            rows=4,
            num_warps=2,
            persistent=4,
            num_stages=2,
            online_mode="chunk_reduce",
            normalize="mul_rcp",
        ),
        dict(block_n=4096, num_warps=8, persistent=1, online_mode="lanewise", normalize="div"),
    ],
    "softmax.split_row": [
        dict(block_n=128, chunks=1, num_warps=1, online_mode="lanewise", norm_order="reverse"),
        dict(block_n=128, chunks=2, num_warps=2, online_mode="three_pass", num_stages=2, normalize="mul_rcp"),
        dict(block_n=1024, chunks=4, num_warps=4, pass1_evict="evict_last", pass2_evict="evict_first", normalize="div"),
    ],
    "swiglu.tile2d": [
        dict(block_n=64, rows=2, num_warps=1, x_load="evict_first", silu="div"),
        dict(block_n=128, rows=4, num_warps=2, persistent=2, num_stages=3, silu="sigmoid", store_cache=".cs"),
        dict(block_n=1024, rows=1, num_warps=8, x_load="cg", persistent=1, num_stages=2),
    ],
    "swiglu.rowloop": [
        dict(block_n=64, rows=2, num_warps=1, num_stages=2, silu="sigmoid"),
        dict(block_n=128, rows=4, num_warps=4, persistent=2, num_stages=3, x_load="evict_first"),
        dict(block_n=2048, rows=1, num_warps=8, persistent=1, silu="div", store_cache=".cs"),
    ],
    "rope.fused_qk": [
        dict(block_t=2, block_h=2, block_hkv=2, halves="join", x_load="evict_first"),
        dict(block_t=4, block_h=8, block_hkv=1, num_warps=2, persistent=2, num_stages=2, cs_evict="evict_last"),
        dict(block_t=1, block_h=32, block_hkv=4, num_warps=8, persistent=1, halves="join", store_cache=".cs"),
    ],
    "rope.separate": [
        dict(block_t=2, block_h=2, halves="join", x_load="cg"),
        dict(block_t=4, block_h=1, num_warps=1, cs_evict="evict_last", store_cache=".cs"),
        dict(block_t=8, block_h=16, num_warps=8, halves="join", x_load="evict_first"),
    ],
}


def _random_points(fam, n=3):
    """n valid points drawn uniformly (deterministic per family) beyond the listed ones."""
    rng = random.Random(zlib.crc32(fam.name.encode()))
    out = []
    for _ in range(2000):
        if len(out) == n:
            break
        p = {k.name: rng.choice(k.values) for k in fam.knobs}
        if fam.valid(p) and p not in out:
            out.append(p)
    return out


def _points(fam):
    """Start point, hand-picked points (fallbacks, persistent, variants), random points."""
    return [dict(fam.start)] + [fam.check_point(p) for p in POINTS.get(fam.name, [])] + _random_points(fam)


# ---------------------------------------------------------------------------------
# module loading


def _load(src, tmp_path, tag):
    path = tmp_path / f"cand_{tag}.py"
    path.write_text(src)
    name = f"_kernelarc_cand_{tag}_{zlib.crc32(src.encode()):08x}"
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod  # inspect.getsource (used by triton) needs a module
    spec.loader.exec_module(mod)
    return mod


def _check(task, outs, ref):
    if not isinstance(outs, tuple):
        outs = (outs,)
    assert len(outs) == len(ref)
    atol, rtol = TOL[task]
    for o, r in zip(outs, ref, strict=True):
        assert o.shape == r.shape and o.dtype == torch.bfloat16
        d = o.double()
        assert torch.isfinite(d).all()
        bad = (d - r).abs() > atol + rtol * r.abs()
        if bad.any():
            idx = bad.nonzero()[0].tolist()
            got, want = d[tuple(idx)].item(), r[tuple(idx)].item()
            pytest.fail(f"{bad.sum().item()} mismatches, first at {idx}: got {got} want {want}")


def _all_families():
    return [f for t in TASKS for f in families_for(t)]


def test_each_task_has_two_families():
    for task in TASKS:
        fams = families_for(task)
        assert len(fams) >= 2, task


@pytest.mark.parametrize("fam", _all_families(), ids=lambda f: f.name)
def test_knob_space(fam):
    start = fam.check_point({})
    assert fam.valid(start)
    for p in POINTS.get(fam.name, []):
        assert fam.valid(fam.check_point(p)), p
    # the space is wide: at least 10^4 raw points
    assert math.prod(len(k.values) for k in fam.knobs) >= 10_000


@pytest.mark.parametrize("fam", _all_families(), ids=lambda f: f.name)
def test_family_correct_interpreter(fam, tmp_path):
    for i, point in enumerate(_points(fam)):
        assert fam.valid(point), point
        src = fam.render(point)
        mod = _load(src, tmp_path, f"{fam.name.replace('.', '_')}_{i}")
        for shape in CPU_SHAPES[fam.task]:
            seed = zlib.crc32(f"{fam.name}/{i}/{shape}".encode())
            gen = torch.Generator().manual_seed(seed)
            inputs = _inputs(fam.task, shape, gen)
            outs = mod.run(*inputs)
            try:
                _check(fam.task, outs, _reference(fam.task, inputs))
            except BaseException as e:
                raise AssertionError(f"{fam.name} point {i} {point} shape {shape}: {e}") from e


@triton.jit
def _cast_roundtrip_kernel(X, Y, Z, N, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    m = o < N
    x = tl.load(X + o, mask=m, other=0.0).to(tl.float32)
    tl.store(Y + o, _cast_out(x * 3.0 + 0.1, Y.dtype.element_ty), mask=m)  # noqa: F821 (set by the test)
    tl.store(Z + o, (x * 3.0 + 0.1).to(Z.dtype.element_ty), mask=m)


def test_interpreter_bf16_store_rounding(tmp_path):
    """bf16 loads upcast exactly; the candidates' store cast rounds to nearest even.

    Triton 3.6's interpreter truncates a plain fp32 -> bf16 ``.to`` (the GPU rounds to
    nearest even), so rendered candidates store through ``_cast_out``, which emulates
    round-to-nearest-even when interpreting.
    """
    fam = families_for("rmsnorm")[0]
    mod = _load(fam.render(dict(fam.start)), tmp_path, "cast_check")
    globals()["_cast_out"] = mod._cast_out
    gen = torch.Generator().manual_seed(3)
    x = _rand(gen, (4000,), 2.0)
    y, z = torch.empty_like(x), torch.empty_like(x)
    _cast_roundtrip_kernel[(1,)](x, y, z, x.numel(), BLOCK=4096)
    want = (x.float() * 3.0 + 0.1).to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), want.view(torch.int16))
    # documents the interpreter behaviour the helper works around (a plain cast truncates)
    trunc = ((x.float() * 3.0 + 0.1).view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(z.view(torch.int16), trunc.view(torch.int16))


def _strided(task, inputs):
    """The same values as views with padded row strides (a slice of a wider buffer)."""

    def pad_rows(t, extra=7):
        buf = torch.empty((*t.shape[:-1], t.shape[-1] + extra), dtype=t.dtype)
        buf[..., : t.shape[-1]] = t
        return buf[..., : t.shape[-1]]

    if task == "rope":
        q, k, cos, sin = inputs
        t, h, d = q.shape
        qkv = torch.empty((t, h + 2 * k.shape[1] + 1, d), dtype=q.dtype)
        qkv[:, :h] = q
        qkv[:, h : h + k.shape[1]] = k
        return (qkv[:, :h], qkv[:, h : h + k.shape[1]], pad_rows(cos), pad_rows(sin))
    return tuple(pad_rows(x) if x.dim() == 2 else x for x in inputs)


@pytest.mark.parametrize("fam", _all_families(), ids=lambda f: f.name)
def test_family_strided_inputs(fam, tmp_path):
    for i, point in enumerate(_points(fam)[:2]):
        mod = _load(fam.render(point), tmp_path, f"{fam.name.replace('.', '_')}_strided_{i}")
        shape = CPU_SHAPES[fam.task][1]
        gen = torch.Generator().manual_seed(zlib.crc32(f"strided/{fam.name}/{i}".encode()))
        inputs = _inputs(fam.task, shape, gen)
        strided = _strided(fam.task, inputs)
        assert any(not x.is_contiguous() for x in strided)
        _check(fam.task, mod.run(*strided), _reference(fam.task, inputs))


# ---------------------------------------------------------------------------------
# ahead-of-time compilation for Hopper (sm_90a)
#
# Triton's own jit helpers (tl.cdiv, ...) become interpreted functions when
# TRITON_INTERPRET=1 is set at import, which breaks compilation; so the AOT gate runs
# once, in a child process without the interpreter, for every family's start point.

_DT = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.float16: "*fp16"}
_LAUNCH_OPTS = ("num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion")


class _Recorder:
    """Stands in for a kernel: records launches instead of running them."""

    def __init__(self, jit):
        self.jit = jit
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append((args, kwargs))

        return launch


def _compile_recorded(rec):
    jit = rec.jit
    seen = set()
    out = []
    for args, kwargs in rec.calls:
        kwargs = dict(kwargs)
        opts = {k: kwargs.pop(k) for k in list(kwargs) if k in _LAUNCH_OPTS}
        names = jit.arg_names
        values = dict(zip(names, args, strict=False))  # the rest come as keywords
        values.update(kwargs)
        sig, consts, attrs = {}, {}, {}
        for i, (name, p) in enumerate(zip(names, jit.params, strict=True)):
            v = values[name]
            if p.is_constexpr:
                sig[name] = "constexpr"
                consts[name] = v
            elif isinstance(v, torch.Tensor):
                sig[name] = _DT[v.dtype]
                attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, bool):
                sig[name] = "i1"
            elif isinstance(v, int):
                sig[name] = "i32" if abs(v) < 2**31 else "i64"
                if v % 16 == 0:
                    attrs[(i,)] = [["tt.divisibility", 16]]
            elif isinstance(v, float):
                sig[name] = "fp32"
            else:
                raise TypeError(f"{name}: {type(v)}")
        key = repr((sorted(consts.items()), sorted(opts.items()), sorted(sig.items())))
        if key in seen:
            continue
        seen.add(key)
        src = ASTSource(fn=jit, signature=sig, constexprs=consts, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        assert "cubin" in compiled.asm, "no cubin"
        # fp32 fused multiply-adds in the PTX (the RoPE kernels must have none: they round as eager does)
        out.append(f"{jit.fn.__name__} {consts} {opts} fma.f32={compiled.asm['ptx'].count('fma.rn.f32')}")
    return out


def _aot_point(fam, point, tmp_path, tag, shapes):
    mod = _load(fam.render(point), tmp_path, tag)
    recs = {}
    for name, obj in list(vars(mod).items()):
        # launched kernels end in _kernel; other jit functions are helpers they call
        if isinstance(obj, JITFunction) and name.endswith("_kernel"):
            recs[name] = _Recorder(obj)
            setattr(mod, name, recs[name])
    assert recs, "no kernels found in the rendered module"
    for shape in shapes:
        mod.run(*_meta_inputs(fam.task, shape))
    compiled = [c for r in recs.values() for c in _compile_recorded(r)]
    assert compiled, "nothing was launched"
    return compiled


def _aot_family(fam, tmp_path):
    """Compile the start point at every GPU shape, the other test points at the first one."""
    results = {}
    for i, point in enumerate(_points(fam)):
        tag = f"{fam.name.replace('.', '_')}_aot{i}"
        shapes = GPU_SHAPES[fam.task] if i == 0 else GPU_SHAPES[fam.task][:1]
        try:
            results[i] = {"ok": True, "kernels": _aot_point(fam, point, tmp_path, tag, shapes)}
        except Exception:
            results[i] = {"ok": False, "point": point, "error": traceback.format_exc()[-3000:]}
    return results


def _aot_main():
    """Child process: compile every family's start point; one JSON object on stdout."""
    import json
    import pathlib
    import tempfile

    assert os.environ.get("TRITON_INTERPRET") != "1"
    part, parts = (int(v) for v in sys.argv[sys.argv.index("--aot") + 1].split("/"))
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="kernelarc_aot_"))
    fams = _all_families()[part::parts]
    results = {fam.name: _aot_family(fam, tmp) for fam in fams}
    sys.stdout.write("\nAOT-RESULTS " + json.dumps(results) + "\n")


@pytest.fixture(scope="module")
def aot_results():
    import json
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    parts = 2  # compilation is CPU-bound: one child per core of a small CI machine
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--aot", f"{i}/{parts}"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=root,
        )
        for i in range(parts)
    ]
    results = {}
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        line = [ln for ln in out.splitlines() if ln.startswith("AOT-RESULTS ")]
        assert line, f"AOT child failed (rc {proc.returncode}):\n{err[-4000:]}"
        results.update(json.loads(line[-1][len("AOT-RESULTS ") :]))
    return results


@pytest.mark.parametrize("fam", _all_families(), ids=lambda f: f.name)
def test_start_point_compiles_for_hopper(fam, aot_results):
    res = aot_results[fam.name]["0"]
    assert res["ok"], res.get("error")
    assert res["kernels"]


@pytest.mark.parametrize("fam", _all_families(), ids=lambda f: f.name)
def test_other_points_compile_for_hopper(fam, aot_results):
    res = aot_results[fam.name]
    assert len(res) == len(_points(fam))
    bad = {i: r for i, r in res.items() if not r["ok"]}
    assert not bad, "\n".join(f"point {r['point']}:\n{r['error']}" for r in bad.values())


@pytest.mark.parametrize("fam", [f for f in _all_families() if f.task == "rope"], ids=lambda f: f.name)
def test_rope_kernels_round_each_product_as_eager_does(fam, aot_results):
    """No fused multiply-add in the compiled RoPE kernels (``enable_fp_fusion=False``): ``x1 * cos - x2 * sin``
    rounds both products before the sum on the GPU as eager PyTorch does, so the bf16 results match the
    reference's bit for bit (the interpreter, numpy, never fuses: only the compiled PTX can show it)."""
    kernels = [k for r in aot_results[fam.name].values() if r["ok"] for k in r["kernels"]]
    assert kernels
    assert all(k.endswith(" fma.f32=0") for k in kernels), kernels


if __name__ == "__main__" and "--aot" in sys.argv:
    _aot_main()


@pytest.mark.parametrize("name", ["softmax.rowblock", "rmsnorm.rowblock", "fused_add_rmsnorm.rowblock"])
def test_long_rows_take_more_warps_instead_of_the_fallback(name, tmp_path):
    """long_rows=more_warps: a row over the register budget at NUM_WARPS runs the whole-row kernel
    with doubled warps (here 1 -> 2 for N=700 at 16 elements per thread); fallback keeps the chunked kernel."""
    fam = next(f for f in _all_families() if f.name == name)
    launched = {}
    for mode in ("fallback", "more_warps"):
        point = fam.check_point(dict(fam.start, max_elems_per_thread=16, num_warps=1, long_rows=mode))
        mod = _load(fam.render(point), tmp_path, f"{name.replace('.', '_')}_{mode}")
        calls = []
        for attr, obj in list(vars(mod).items()):
            # JITFunction on a GPU, InterpretedFunction under TRITON_INTERPRET: both launch as kernel[grid](...)
            if attr.endswith("_kernel") and hasattr(obj, "__getitem__"):

                class _Spy:
                    def __init__(self, fn, attr, log):
                        self.fn, self.attr, self.log = fn, attr, log

                    def __getitem__(self, grid):
                        def launch(*args, **kw):
                            self.log.append((self.attr, kw.get("num_warps")))
                            return self.fn[grid](*args, **kw)

                        return launch

                setattr(mod, attr, _Spy(obj, attr, calls))
        gen = torch.Generator().manual_seed(7)
        inputs = _inputs(fam.task, (3, 700), gen)
        _check(fam.task, mod.run(*inputs), _reference(fam.task, inputs))
        launched[mode] = calls
    assert all("fallback" in a or "chunked" in a for a, _ in launched["fallback"]), launched
    assert launched["more_warps"] and all("rows" in a and w == 2 for a, w in launched["more_warps"]), launched
