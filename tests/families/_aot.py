"""Helpers shared by the family tests: loading rendered candidates, checking bf16 outputs against a
float64 reference, and ahead-of-time compilation of family kernels for sm_90a without a GPU."""

import hashlib
import importlib.util
import json
import os
import sys

import torch

# The interpreter flag is read when triton.language is imported (its own @jit helpers such
# as tl.cdiv become interpreted functions), so ahead-of-time compilation runs in a child
# process without TRITON_INTERPRET.
_AOT_CHILD = r"""
import importlib.util, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kernelarc.families.base import ptxas_usage
out = {}
for label, path, jobs in json.load(sys.stdin):
    spec = importlib.util.spec_from_file_location("cand_" + label.replace(".", "_"), path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = []
    for job in jobs:
        attrs = {tuple(k): v for k, v in job["attrs"]}
        src = ASTSource(fn=getattr(mod, job["kernel"]), signature=job["signature"],
                        constexprs=job["constexprs"], attrs=attrs)
        try:
            c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=job["options"])
        except Exception as e:
            res.append({"kernel": job["kernel"], "error": f"{type(e).__name__}: {e}"[-2000:]})
            continue
        ptx = c.asm["ptx"]
        regs, spill = ptxas_usage(ptx)
        res.append({"kernel": job["kernel"], "sm90a": ".target sm_90a" in ptx, "regs": regs, "spill": spill,
                    "wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
                    "setmaxnreg": "setmaxnreg" in ptx, "shared": c.metadata.shared})
    out[label] = res
print(json.dumps(out))
"""


def aot_compile(items, tmp_dir):
    """items: [(label, source, jobs)] -> {label: [per-kernel result dict]} (sm_90a, no GPU)."""
    import subprocess

    payload = []
    for label, src, jobs in items:
        path = tmp_dir / f"aot_{label.replace('.', '_')}.py"
        path.write_text(src)
        jobs = [{**j, "attrs": [[list(k), v] for k, v in j["attrs"].items()]} for j in jobs]
        payload.append((label, str(path), jobs))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-c", _AOT_CHILD],
        input=json.dumps(payload),
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if os.environ.get("KERNELARC_AOT_REPORT"):  # registers and spills of every kernel compiled, one JSON line each
        with open(os.environ["KERNELARC_AOT_REPORT"], "a") as f:
            f.write(json.dumps(out) + "\n")
    return out


def load_source(src: str, tmp_dir, interpret: bool = True):
    """Import a rendered candidate from a file (Triton's JIT needs real source files)."""
    name = "cand_" + hashlib.sha1(src.encode()).hexdigest()[:16]
    path = tmp_dir / f"{name}.py"
    path.write_text(src)
    old = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        if old is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = old
    sys.modules.pop(name, None)
    return module


TOL_REL_NORM = 1e-2
TOL_ELEM = 2e-2  # relative to max |ref|, plus rtol 2e-2


def check_close(out, ref) -> None:
    """bf16 ``out`` against a float64 ``ref``: relative error norm and an elementwise bound."""
    assert out.shape == ref.shape and out.dtype == torch.bfloat16
    out = out.double()
    assert torch.isfinite(out).all(), "non-finite output"
    rel = ((out - ref).norm() / ref.norm()).item()
    assert rel < TOL_REL_NORM, f"relative error norm {rel:.3e}"
    bad = (out - ref).abs() > TOL_ELEM * ref.abs().max() + TOL_ELEM * ref.abs()
    if bad.any():
        idx = tuple(bad.nonzero()[0].tolist())
        raise AssertionError(f"first mismatch at {idx}: {out[idx].item()} vs {ref[idx].item()}")
