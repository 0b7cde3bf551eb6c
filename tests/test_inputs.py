"""Inputs: any layout (expanded views) rotated in place, distributions per seed, CPU shrinking."""

import json
from pathlib import Path

import pytest
import torch

from kernelarc.guard.judge import Guard, GuardConfig, reference_candidate
from kernelarc.models import Candidate, Status
from kernelarc.tasks import load_builtin, load_task
from kernelarc.tasks.inputs import (
    DISTRIBUTIONS,
    Distribution,
    Role,
    clone_layout,
    distribution_for,
    has_internal_overlap,
    load_module,
    make_inputs,
    refill,
    role_of,
    share_elements,
    snapshot,
)
from kernelarc.tasks.loader import TaskError, fit_workloads

SHARED = Path(__file__).resolve().parents[2] / "shared" / "sol-execbench"

EXPANDED_REFERENCE = """import torch

def make_inputs(axes, device):
    M, N = axes["M"], axes["N"]
    # a broadcast bias (stride 0 along M) and a transposed, non-contiguous x: layouts real problems make
    return {"x": torch.randn(N, M, device=device).t(), "bias": torch.randn(1, N, device=device).expand(M, N)}

def run(x, bias):
    return x * 2.0 + bias
"""


def _expanded_problem(tmp_path: Path) -> Path:
    d = {
        "name": "expanded_bias",
        "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": 48}},
        "inputs": {"x": {"shape": ["M", "N"], "dtype": "float32"}, "bias": {"shape": ["M", "N"], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["M", "N"], "dtype": "float32"}},
        "reference": EXPANDED_REFERENCE,
        "custom_inputs_entrypoint": "make_inputs",
    }
    (tmp_path / "definition.json").write_text(json.dumps(d))
    wls = [{"uuid": f"w{m}", "axes": {"M": m}, "inputs": {"x": {"type": "custom"}, "bias": {"type": "custom"}}}
           for m in (16, 37)]  # fmt: skip
    (tmp_path / "workload.jsonl").write_text("\n".join(json.dumps(w) for w in wls))
    return tmp_path


def test_refill_writes_expanded_views_in_place():
    a = [torch.randn(1, 8).expand(4, 8), torch.randn(6, 3).t(), 2.5]
    b = [torch.randn(1, 8).expand(4, 8), torch.randn(6, 3).t(), 3.5]
    assert has_internal_overlap(a[0]) and not has_internal_overlap(a[1])
    with pytest.raises(RuntimeError, match="single memory location"):
        a[0].copy_(b[0])  # what the worker did before (issue 13)
    ptrs = [a[0].data_ptr(), a[1].data_ptr()]
    saved = snapshot(a)
    assert saved[0].stride() == (0, 1) and saved[0].data_ptr() != ptrs[0]
    assert refill(a, b) == []
    assert all(torch.equal(x, y) for x, y in zip(a[:2], b[:2], strict=True)) and a[2] == 3.5
    assert [a[0].data_ptr(), a[1].data_ptr()] == ptrs  # same buffers, new contents
    refill(a, saved)
    assert torch.equal(a[0], saved[0]) and a[0].data_ptr() == ptrs[0]


def test_refill_of_views_sharing_one_base_and_of_other_layouts():
    base_a, base_b = torch.randn(3, 10), torch.randn(3, 10)
    a, b = list(base_a.split([4, 6], dim=1)), list(base_b.split([4, 6], dim=1))
    refill(a, b)
    assert torch.equal(base_a, base_b)
    # an expanded destination whose source is laid out differently cannot be written: it is replaced
    dst = [torch.randn(1, 5).expand(3, 5)]
    src = [torch.randn(3, 5)]
    assert refill(dst, src) == [0] and torch.equal(dst[0], src[0])
    c = clone_layout(torch.randn(2, 1).expand(2, 7))
    assert c.stride() == (1, 0)


def test_a_problem_with_expanded_inputs_runs_through_the_guard(tmp_path):
    task = load_task(_expanded_problem(tmp_path))
    x, bias = make_inputs(task, 1, 3, "cpu")
    assert bias.stride() == (0, 1) and not x.is_contiguous()
    cfg = GuardConfig(timeout_s=60, target_ms=2, min_iters=2, max_iters=4, prestart=1, seeds=2)
    with Guard(task, None, "cpu", cfg) as g:
        ref = g.evaluate(reference_candidate(task), trusted=True)
        assert ref.verdict.correct, ref.verdict.errors
        good = "import torch\ndef run(x, bias):\n    return torch.addcmul(bias, x, torch.full_like(x, 2.0))\n"
        v = g.evaluate(Candidate(source=good, language="pytorch")).verdict
        assert v.correct, v.errors
        bad = "import torch\ndef run(x, bias):\n    return x * 2.0 + bias[:1]\n"  # row 0's bias broadcast: same here
        assert g.evaluate(Candidate(source=bad, language="pytorch")).verdict.correct
        wrong = "import torch\ndef run(x, bias):\n    return x * 2.0\n"
        assert g.evaluate(Candidate(source=wrong, language="pytorch")).verdict.status is Status.incorrect


def test_seeds_cycle_through_distributions_and_inputs_are_deterministic():
    assert {distribution_for(s) for s in range(100, 100 + len(DISTRIBUTIONS))} == set(DISTRIBUTIONS)
    t = load_builtin("rmsnorm", cpu=True)
    stats = {}
    for s in range(len(DISTRIBUTIONS)):
        x, w = make_inputs(t, 0, s, "cpu")
        x2, _ = make_inputs(t, 0, s, "cpu")
        assert torch.equal(x, x2) and x.abs().sum() > 0
        stats[distribution_for(s)] = x.float()
    assert stats[Distribution.negative].max() <= 0
    assert stats[Distribution.shifted].mean() > 1.0
    assert stats[Distribution.scaled].std() > 3 * stats[Distribution.sol].std()
    assert stats[Distribution.outliers].abs().max() >= 16


def test_roles_keep_the_reference_valid_in_every_distribution():
    assert role_of("rstd", (4,)) is Role.positive and role_of("x_var", (4, 2)) is Role.positive
    assert role_of("post_attention_layernorm_weight", (64,)) is Role.norm_weight
    assert role_of("norm1_bias", (64,)) is Role.norm_bias
    assert role_of("q_proj_weight", (64, 32)) is Role.weight_matrix and role_of("weight", (64,)) is Role.plain
    assert role_of("attention_mask", (1, 1, 8, 8)) is Role.causal_mask
    assert role_of("x_mask", (2, 1, 9)) is Role.binary_mask
    t = load_task(SHARED / "L1" / "013_fused_residual_rms_norm_backward")
    i = min(range(len(t.workloads)), key=t.io_bytes)
    k = t.input_names.index("rstd")
    for s in range(len(DISTRIBUTIONS)):
        assert make_inputs(t, i, s, "cpu")[k].min() > 0


def test_fp16_outliers_and_scaling_do_not_overflow_the_reference(tmp_path):
    d = json.loads((load_builtin("rmsnorm").path / "definition.json").read_text())
    d["inputs"] = {k: {**v, "dtype": "float16"} for k, v in d["inputs"].items()}
    d["outputs"] = {k: {**v, "dtype": "float16"} for k, v in d["outputs"].items()}
    (tmp_path / "definition.json").write_text(json.dumps(d))
    wl = {"uuid": "a", "axes": {"M": 64, "N": 4096}, "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}}}
    (tmp_path / "workload.jsonl").write_text(json.dumps(wl))
    t = load_task(tmp_path)
    ref = load_module(t.definition.reference, "ref_fp16")
    for s in range(len(DISTRIBUTIONS)):
        out = ref.run(*make_inputs(t, 0, s, "cpu"))
        assert torch.isfinite(out).all(), distribution_for(s)


def test_too_big_workloads_are_shrunk_within_the_constraints(tmp_path):
    t = load_task(SHARED / "FlashInfer-Bench" / "024_rmsnorm_h2048")
    big = [i for i in range(len(t.workloads)) if t.io_bytes(i) > 8 << 20]
    assert big
    f = fit_workloads(t, 8 << 20)
    assert len(f.workloads) == len(t.workloads)
    assert all(f.io_bytes(i) <= 8 << 20 for i in range(len(f.workloads)))
    assert sum("shrunk for the CPU" in w for w in f.warnings) == len(big)
    # a guard worker loading the task by path sees the shrunk set
    again = load_task(f.path, workload_file=f.workload_file)
    assert [w.axes for w in again.workloads] == [w.axes for w in f.workloads]
    # a constraint the halving must keep: N stays a multiple of 64, so 96 -> 48 is refused and M shrinks
    d = json.loads((load_builtin("rmsnorm").path / "definition.json").read_text())
    d["constraints"] = ["N % 64 == 0"]
    (tmp_path / "definition.json").write_text(json.dumps(d))
    wl = {
        "uuid": "a",
        "axes": {"M": 40000, "N": 192},
        "inputs": {"x": {"type": "random"}, "weight": {"type": "random"}},
    }
    (tmp_path / "workload.jsonl").write_text(json.dumps(wl))
    s = fit_workloads(load_task(tmp_path), 1 << 20)
    assert s.workloads[0].axes["N"] % 64 == 0 and s.io_bytes(0) <= 1 << 20
    d["constraints"] = ["M == 40000"]
    (tmp_path / "definition.json").write_text(json.dumps(d))
    d2 = fit_workloads(load_task(tmp_path), 1 << 10)  # M may not move: N goes as far as it can, with a warning
    assert d2.workloads[0].axes == {"M": 40000, "N": 1} and "still above" in d2.warnings[-1]
    d["constraints"] = ["M == 40000", "N == 192"]
    (tmp_path / "definition.json").write_text(json.dumps(d))
    d3 = fit_workloads(load_task(tmp_path), 1 << 10)
    assert d3.workloads[0].axes == {"M": 40000, "N": 192} and "cannot be shrunk" in d3.warnings[-1]
    with pytest.raises(TaskError):
        load_task(tmp_path / "missing")


def test_a_workload_whose_bytes_are_a_const_table_keeps_its_axes(tmp_path):
    """Found on a problem written to test unseen patterns: a 64 MB embedding table of const shape beside small
    token inputs; halving the var axes saved 5% and took every workload to batch 1 x seq 1, where no bug that
    depends on the sequence shows. A halving that saves under a tenth is not taken."""
    d = {
        "name": "emb", "axes": {"M": {"type": "var"}, "V": {"type": "const", "value": 65536},
                                "D": {"type": "const", "value": 256}},
        "inputs": {"ids": {"shape": ["M"], "dtype": "int64"}, "table": {"shape": ["V", "D"], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["M", "D"], "dtype": "float32"}},
        "reference": "import torch\n\ndef run(ids, table):\n    return table[ids % table.shape[0]]\n",
    }  # fmt: skip
    (tmp_path / "definition.json").write_text(json.dumps(d))
    wl = {"uuid": "a", "axes": {"M": 4096}, "inputs": {"ids": {"type": "random"}, "table": {"type": "random"}}}
    (tmp_path / "workload.jsonl").write_text(json.dumps(wl))
    f = fit_workloads(load_task(tmp_path), 32 << 20)
    assert f.workloads[0].axes == {"M": 4096}
    assert "cannot be shrunk" in f.warnings[-1] and "const-shaped inputs" in f.warnings[-1], f.warnings


def test_shrinking_that_breaks_the_reference_keeps_the_workload():
    # the reference ties time_after_conv to time_dim through its convolutions, the definition does not
    t = load_task(SHARED / "L2" / "015_audio_sinusoidal_position_embedding_with_conv_projection")
    f = fit_workloads(t, 32 << 20)
    kept = [w for w in f.warnings if "cannot be shrunk" in w and "not the definition's" in w]
    assert kept
    i = int(kept[0].split("workload ")[1].split()[0])
    assert f.workloads[i].axes == t.workloads[i].axes


def test_share_elements_tells_split_views_from_overlap():
    t = torch.randn(4, 10)
    a, b = t.chunk(2, dim=1)
    assert not share_elements(a, b) and share_elements(a, t) and share_elements(t[:, :6], t[:, 4:])
    assert not share_elements(torch.randn(3), torch.randn(3))
    assert share_elements(t, t.view(torch.int16))  # other itemsize on one buffer: conservatively shared


def test_a_reference_returning_split_views_of_one_buffer_is_correct(tmp_path):
    d = {
        "name": "split_outputs",
        "axes": {"M": {"type": "var"}, "N": {"type": "const", "value": 32}, "H": {"type": "const", "value": 16}},
        "inputs": {"x": {"shape": ["M", "N"], "dtype": "float32"}},
        "outputs": {"lo": {"shape": ["M", "H"], "dtype": "float32"}, "hi": {"shape": ["M", "H"], "dtype": "float32"}},
        "reference": "import torch\n\ndef run(x):\n    return (x * 2.0).chunk(2, dim=1)\n",
    }
    (tmp_path / "definition.json").write_text(json.dumps(d))
    (tmp_path / "workload.jsonl").write_text(
        json.dumps({"uuid": "a", "axes": {"M": 8}, "inputs": {"x": {"type": "random"}}})
    )
    task = load_task(tmp_path)
    cfg = GuardConfig(timeout_s=60, target_ms=2, min_iters=2, max_iters=4, prestart=1, seeds=2)
    with Guard(task, None, "cpu", cfg) as g:
        ref = g.evaluate(reference_candidate(task), trusted=True).verdict
        assert ref.correct, ref.errors  # the layout contract holds: each chunk has the reference's strides
        dense = "import torch\n\ndef run(x):\n    y = x * 2.0\n    return y[:, :16].contiguous(), y[:, 16:] + 0\n"
        v = g.evaluate(Candidate(source=dense, language="pytorch")).verdict
        assert v.correct, v.errors  # contiguous outputs are always a valid layout
        same = "import torch\n\ndef run(x):\n    y = x * 2.0\n    return y, y\n"
        v = g.evaluate(Candidate(source=same.replace("return y, y", "return y[:, :16], y[:, :16]"), language="pytorch"))
        assert v.verdict.status is Status.incorrect and "overlaps another output" in " ".join(v.verdict.errors)


def test_the_module_folder_is_removed_when_its_process_exits(tmp_path):
    # every process that loads a candidate makes one folder of module files; a day of sessions left hundreds behind
    code = (
        "import os, sys\n"
        "from kernelarc.tasks.inputs import load_module\n"
        "m = load_module('X = 1\\n', 'probe')\n"
        "print(os.path.dirname(m.__file__))\n"
        "if os.fork() == 0:\n"  # a forked child's exit leaves its parent's folder alone
        "    sys.exit(0)\n"
        "os.wait()\n"
        "print(os.path.isdir(os.path.dirname(m.__file__)))\n"
    )
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    folder, alive_after_child = proc.stdout.split()
    assert alive_after_child == "True"
    assert folder and not Path(folder).exists()


def test_a_killed_process_module_folder_is_swept_by_a_later_one(tmp_path):
    """A process killed before its exit handler leaves its folder; the next process that makes one removes such
    folders whose owner is dead and that are older than STALE_MODULE_DIR_S, and keeps the rest."""
    import os
    import subprocess
    import sys
    import time

    from kernelarc.tasks.inputs import STALE_MODULE_DIR_S, _sweep_module_dirs

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    old = time.time() - STALE_MODULE_DIR_S - 60
    folders = {
        "dead_old": tmp_path / f"kernelarc-modules-{dead}-abc",
        "dead_new": tmp_path / f"kernelarc-modules-{dead}-def",
        "alive_old": tmp_path / f"kernelarc-modules-{os.getpid()}-ghi",
        "unnamed_old": tmp_path / "kernelarc-modules-xyz_1",  # the former names, without a pid: left alone
    }
    for key, f in folders.items():
        f.mkdir()
        (f / "m.py").write_text("X = 1\n")
        if key.endswith("old"):
            os.utime(f, (old, old))
    _sweep_module_dirs(str(tmp_path))
    assert {k for k, f in folders.items() if f.exists()} == {"dead_new", "alive_old", "unnamed_old"}
