"""CUTLASS GEMM family: knob space, rendering, guard compatibility, export, and one real
sm_90a build of the start point with nvcc (skipped where nvcc or the headers are missing;
about a minute on two cores)."""

from __future__ import annotations

import ctypes
import itertools

import pytest
import torch

from kernelarc import cutlass
from kernelarc.families.cutlass_gemm import CUTLASS_GEMM, render_cpp, valid
from kernelarc.guard.static import check_source
from kernelarc.models import Candidate

needs_toolchain = pytest.mark.skipif(not cutlass.available(), reason="needs nvcc and nvidia-cutlass headers")


def test_knob_space_is_wide_and_the_start_is_feasible():
    fam = CUTLASS_GEMM
    assert fam.valid(fam.check_point({}))
    names = [k.name for k in fam.knobs]
    points = [dict(zip(names, vals, strict=True)) for vals in itertools.product(*[k.values for k in fam.knobs])]
    feasible = [p for p in points if valid(p)]
    assert len(points) >= 10_000 and 0.1 < len(feasible) / len(points) < 0.9


@pytest.mark.parametrize(
    "point, ok",
    [
        (dict(BLOCK_M=64, SCHEDULE="cooperative"), False),  # cooperative splits >= 128 rows over two warpgroups
        (dict(BLOCK_M=64, BLOCK_N=256, SCHEDULE="pingpong"), True),  # 128 accumulators per thread
        (dict(BLOCK_M=128, BLOCK_N=256, SCHEDULE="pingpong"), False),  # 256 per thread: spills
        (dict(BLOCK_M=128, BLOCK_N=256, SCHEDULE="cooperative"), True),
        (dict(BLOCK_M=256, BLOCK_N=256, BLOCK_K=128, STAGES=2), False),  # 2 x 128 KB stages do not fit
    ],
)
def test_feasibility_rules(point, ok):
    assert valid(CUTLASS_GEMM.check_point(point)) is ok


def test_rendered_candidate_is_a_cutlass_candidate_the_guard_accepts():
    k = CUTLASS_GEMM.check_point(dict(BLOCK_N=256, CLUSTER_M=2, TILE_SCHEDULER="stream_k", RASTER="along_n"))
    src = CUTLASS_GEMM.render(k)
    cpp = render_cpp(k)
    assert "$" not in cpp.replace("$$", "")
    assert "Shape<_128, _256, _64>" in cpp and "Shape<_2, _1, _1>" in cpp and "StreamKScheduler" in cpp
    assert "RasterOrderOptions::AlongN" in cpp
    report = check_source(src)
    assert report.ok, report.violations
    cand = Candidate(source=src, language=CUTLASS_GEMM.language, family=CUTLASS_GEMM.name, knobs=k)
    assert cand.language == "cutlass"


def test_export_inlines_the_build_helper(tmp_path):
    from kernelarc.exporting import export_solution

    src = CUTLASS_GEMM.render(CUTLASS_GEMM.start)
    cand = Candidate(source=src, language="cutlass", family=CUTLASS_GEMM.name, knobs=dict(CUTLASS_GEMM.start))
    path = export_solution(cand, "gemm_bf16", tmp_path, fmt="python")
    text = path.read_text()
    assert "from kernelarc" not in text and "def load(" in text and "def run(A, B)" in text
    compile(text, str(path), "exec")  # the self-contained solution parses


@pytest.fixture(scope="module")
def built_start(tmp_path_factory):
    """One nvcc build of the start point (about a minute on two cores), shared by the tests below."""
    import os

    old = os.environ.get("KERNELARC_CUTLASS_CACHE")
    os.environ["KERNELARC_CUTLASS_CACHE"] = str(tmp_path_factory.mktemp("cutlass_cache"))
    try:
        yield cutlass.build(render_cpp(CUTLASS_GEMM.check_point({})))
    finally:
        if old is None:
            os.environ.pop("KERNELARC_CUTLASS_CACHE", None)
        else:
            os.environ["KERNELARC_CUTLASS_CACHE"] = old


@needs_toolchain
def test_start_point_builds_for_sm90a_without_spills(built_start):
    lib = built_start
    usage = cutlass.resource_usage(lib)
    assert usage["kernels"] >= 1 and usage["spill_bytes"] == 0, usage
    log = lib.with_name("build.log").read_text()
    assert "MainloopSm90TmaGmmaWarpSpecialized" in log and "SM90_TMA_LOAD" in log  # TMA + wgmma mainloop
    handle = ctypes.CDLL(str(lib))  # loads without a GPU (cudart is linked statically)
    assert handle.kernelarc_run and handle.kernelarc_workspace
    # cached: a second build is a lookup
    assert cutlass.build(render_cpp(CUTLASS_GEMM.check_point({}))) == lib


def test_build_errors_are_reported_not_crashed(tmp_path, monkeypatch):
    if cutlass.nvcc() is None:
        with pytest.raises(cutlass.CutlassUnavailable):
            cutlass.build("int main() { return 0; }")
        return
    monkeypatch.setenv("KERNELARC_CUTLASS_CACHE", str(tmp_path / "cache"))
    if not cutlass.available():
        pytest.skip("needs nvidia-cutlass headers")
    with pytest.raises(RuntimeError, match="nvcc failed"):
        cutlass.build('extern "C" int kernelarc_run( { syntax error')


@needs_toolchain
def test_guard_builds_a_cutlass_candidate_and_reports_the_build(built_start):
    """Through the real guard on the CPU: the build (cached) happens in the worker's import phase, its
    ptxas report reaches the verdict, and the missing GPU gives a clear runtime error, not a crash."""
    from kernelarc.guard.judge import Guard, GuardConfig
    from kernelarc.models import Status
    from kernelarc.tasks import load_builtin

    task = load_builtin("matmul", cpu=True)
    src = CUTLASS_GEMM.render(CUTLASS_GEMM.start)
    with Guard(task, None, "cpu", GuardConfig(workloads=[0], timeout_s=120, prestart=1)) as g:
        v = g.evaluate(Candidate(source=src, language="cutlass", family=CUTLASS_GEMM.name)).verdict
    assert v.status is Status.runtime_error and "CUDA tensors" in v.errors[0], v
    assert any(w.startswith("cutlass build: 1 kernel(s)") and "0 spill bytes" in w for w in v.warnings), v.warnings


class _FakeKernel:
    """Stands in for the built library: checks the TMA layout contract the real one relies on
    (16-byte rows and addresses) and computes C = A @ B^T in fp32."""

    def __init__(self):
        self.calls = []

    def __call__(self, inputs, outputs, dims):
        (a, b), (c,), (m, n, k) = inputs, outputs, dims
        self.calls.append((m, n, k))
        assert k % 8 == 0 and n % 8 == 0 and a.shape == (m, k) and b.shape == (n, k) and c.shape == (m, n)
        assert all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in (a, b, c))
        c.copy_((a.float() @ b.float().T).to(c.dtype))


def test_odd_k_and_n_are_padded_for_tma(monkeypatch):
    from kernelarc import cutlass
    from kernelarc.tasks.inputs import load_module

    fake = _FakeKernel()
    monkeypatch.setattr(cutlass, "load", lambda source: fake)
    mod = load_module(CUTLASS_GEMM.render(dict(CUTLASS_GEMM.start)), "cutlass_fake")
    gen = torch.Generator().manual_seed(3)
    for m, n, k in [(37, 50, 70), (16, 64, 64), (5, 3, 1)]:
        a = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        b = torch.randn(n, k, generator=gen).to(torch.bfloat16)
        c = mod.run(a, b)
        assert c.shape == (m, n) and c.is_contiguous()
        torch.testing.assert_close(c.float(), (a.double() @ b.double().T).float(), rtol=2e-2, atol=2e-2)
    assert fake.calls == [(37, 56, 72), (16, 64, 64), (5, 8, 8)]
    misaligned = torch.randn(16 * 64 + 1).to(torch.bfloat16)[1:].view(16, 64)  # 2-byte offset
    mod.run(misaligned, torch.randn(64, 64).to(torch.bfloat16))  # copied to an aligned buffer first
    with pytest.raises(ValueError, match="bf16"):
        mod.run(torch.randn(8, 8), torch.randn(8, 8))


def test_a_too_deep_pipeline_is_one_step_from_the_automatic_stage_count():
    """Seen on the H200: every 128x256 / 256x128 point the search built had BLOCK_K 32, because a
    fixed deep pipeline made BLOCK_K 64 infeasible and the nearest repair always thinned K. With
    "as many stages as fit" next to 7, the repair reaches 128x256x64 too."""
    import random

    from kernelarc.agents.surrogate import repair

    deep = dict(CUTLASS_GEMM.start, STAGES=7, BLOCK_N=256)
    assert not valid(deep)
    outcomes = {
        (p["BLOCK_K"], p["STAGES"])
        for p in (repair(CUTLASS_GEMM, deep, ["BLOCK_N"], random.Random(seed)) for seed in range(40))
    }
    assert (64, 0) in outcomes and (32, 7) in outcomes


def _fake_nvcc(folder) -> str:
    """A stand-in for nvcc that writes its ``-o`` file (the build's file handling is what is tested)."""
    exe = folder / "fake-nvcc"
    exe.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do if [ "$1" = -o ]; then echo lib > "$2"; fi; shift; done\n')
    exe.chmod(0o755)
    return str(exe)


def _as(uid: int, gid: int, fn) -> int:
    """Run ``fn`` in a child that dropped to ``uid``/``gid`` with the guard workers' umask; its exit code."""
    import os

    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:  # noqa: SIM105 - any failure is the exit code
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            os.umask(0o007)
            fn()
            code = 0
        except BaseException as e:  # noqa: BLE001
            print(f"child {uid}: {type(e).__name__}: {e}", flush=True)
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_library_one_worker_built_loads_in_another_workers_uid(tmp_path, monkeypatch):
    """Guard workers of one role share the CUTLASS cache through their group, each under its own uid: a
    library built by one must be readable by the next (mkstemp's 0600 made every later load fail with
    "Permission denied": the softmax.cutlass_sm90 start point on the H200)."""
    import os
    import shutil
    import tempfile

    if os.geteuid() != 0:
        pytest.skip("needs root to run as two uids")
    from pathlib import Path

    root = tempfile.mkdtemp(prefix="kernelarc-cache-test-")
    tools = Path(tempfile.mkdtemp(prefix="kernelarc-nvcc-test-"))
    tools.chmod(0o755)
    fake = _fake_nvcc(tools)
    monkeypatch.setattr(cutlass, "nvcc", lambda: fake)
    monkeypatch.setattr(cutlass, "include_dirs", lambda: [])
    try:
        gid = 61990
        os.chown(root, 0, gid)
        os.chmod(root, 0o770)
        monkeypatch.setenv("KERNELARC_CUTLASS_CACHE", root)
        assert _as(61991, gid, lambda: cutlass.build("// one source")) == 0
        (lib,) = list(Path(root).rglob("kernel.so"))
        assert _as(61992, gid, lambda: lib.read_bytes()) == 0, oct(lib.stat().st_mode)
        # and the second worker finds it built: a cache hit, no second build
        assert _as(61993, gid, lambda: cutlass.build("// one source")) == 0
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tools, ignore_errors=True)


def test_the_cpp_of_every_cutlass_family_passes_the_source_check_and_hostile_cpp_is_a_hack():
    """A CUTLASS library is loaded into the guard's worker, beside the timer: its C++ may include CUTLASS, CuTe,
    CUDA's and computational headers, and may not reach past the kernel (loaders, the Python C API, processes and
    threads, files, host callbacks, system calls, constructors, token pasting). Every family's C++ passes at random
    points; hostile C++ is refused before nvcc runs, and the guard's verdict is a hack (on a CPU too)."""
    import random

    from kernelarc.families import cutlass_fmha, cutlass_fp8_gemm, cutlass_gemm, cutlass_softmax
    from kernelarc.guard.judge import Guard, GuardConfig
    from kernelarc.models import Status
    from kernelarc.tasks import load_builtin

    rng = random.Random(0)
    for mod in (cutlass_gemm, cutlass_fmha, cutlass_fp8_gemm, cutlass_softmax):
        fam = next(v for v in vars(mod).values() if getattr(v, "language", None) == "cutlass")
        for _ in range(20):
            k = fam.check_point({kn.name: rng.choice(kn.values) for kn in fam.knobs})
            assert cutlass.check_source(mod.render_cpp(k)) == [], (fam.name, k)
    hostile = [
        '#include <dlfcn.h>\nextern "C" int kernelarc_run() { return dlopen(0, 0) != 0; }',
        'extern "C" void* dlsym(void*, const char*);\nextern "C" int kernelarc_run() { return 0; }',
        'extern "C" int PyRun_SimpleString(const char*);\nextern "C" int kernelarc_run() { return 0; }',
        "#include <thread>\nint kernelarc_run() { return 0; }",
        "__attribute__((constructor)) static void at_load() {}",
        'int kernelarc_run() { asm volatile("syscall"); return 0; }',
        "#define CAT(a, b) a##b\nint kernelarc_run() { return 0; }",
        "int kernelarc_run(void* s) { cudaLaunchHostFunc((cudaStream_t)s, 0, 0); return 0; }",
        # a seventh red team's spellings past a first version of the check
        'extern "C" int ka(const char*) __asm__("system");',
        'const char* u = "http://x"; void* h = dlopen(0, 2);',
        "int x = sys\\\ntem(0);",
        "#define HDR <dlfcn.h>\n#include HDR",
        "%:include <unistd.h>",
        "__attribute__((__constructor__)) static void f() {}",
        "[[gnu::__constructor__]] static void f() {}",
        "struct S { S() { std::remove(0); } } s;",
        "char q = '\"'; void* p = (void*)&dlsym; char r = '\"';",
        'const char* r = R"(")"; int k = kill(0, 9); const char* t = R"(")";',
        "FILE* f = fdopen(1, 0);",
        "#import <unistd.h>",
        "#inc\\\nlude <unistd.h>",
        '__attribute__((section(".init_array"))) void (*p)() = 0;',
        'asm(".incbin \\"/etc/hostname\\"");',
    ]
    for cpp in hostile:
        assert cutlass.check_source(cpp), cpp
    assert cutlass.check_source('// a tile of 128 rows\nconst char* s = "tile";\n') == []
    assert cutlass.check_source("// dlopen named in a comment: a string can hide the rest of a line from comments\n")
    src = "import torch\nfrom kernelarc import cutlass\n_K = cutlass.load(" + repr(hostile[2]) + ")\n"
    src += "def run(x, weight):\n    return x\n"
    task = load_builtin("rmsnorm", cpu=True)
    g = Guard(task, None, "cpu", GuardConfig(timeout_s=60, prestart=0))
    try:
        v = g.evaluate(Candidate(source=src, language="cutlass")).verdict
    finally:
        g.close()
    assert v.status is Status.rejected_hack and "CUTLASS source refused" in " ".join(v.errors), (v.status, v.errors)
