"""Registry: versions from child-run artifacts, champion alias rules, kernels load back and run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from kernelarc.models import Candidate, Status, Verdict
from kernelarc.registry import Registry, collect_versions_info, model_name
from kernelarc.tracking import Tracker

TASK, GPU = "rmsnorm", "cpu"
SECRET = "sk-ant-api03-REGISTRYSECRET-0123456789"

# A tiny but real kernel: RMSNorm in PyTorch, value-returning run(*inputs).
RMSNORM_SOURCE = """\
import torch


def run(x, weight, eps=1e-6):
    xf = x.float()
    rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (xf * rstd * weight.float()).to(x.dtype)
"""


@pytest.fixture
def tracker(workdir) -> Tracker:
    tr = Tracker(None, TASK, GPU)
    tr.start_session({"task": TASK})
    return tr


def candidate(scale: str = "", **kw) -> Candidate:
    source = RMSNORM_SOURCE if not scale else RMSNORM_SOURCE + f"\n# variant {scale}\n"
    fields = dict(source=source, language="pytorch", agent="a0", strategy="fusion", family="rms", knobs={"BLOCK": 256})
    fields.update(kw)
    return Candidate(**fields)


def verdict(cand: Candidate, status: Status = Status.champion, latency: float = 0.5) -> Verdict:
    return Verdict(
        candidate_id=cand.id,
        status=status,
        latency_ms=latency,
        speedup_vs_baseline=1.8,
        sol_fraction=0.7,
        sol_score=0.8,
        tbps=2.5,
    )


def logged(tracker: Tracker, cand: Candidate, v: Verdict | None = None) -> tuple[Verdict, str]:
    v = v or verdict(cand)
    return v, tracker.log_candidate(cand, v)


def import_kernel(path: Path):
    spec = importlib.util.spec_from_file_location(f"kernel_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_model_name():
    assert model_name("attention", "h200") == "kernelarc.attention.h200"
    assert model_name("a/b:c", "h200") == "kernelarc.a_b_c.h200"
    with pytest.raises(ValueError):
        model_name("", "h200")


def test_register_loads_back_and_runs_on_cpu(tracker, workdir):
    reg = Registry(tracker, TASK, GPU)
    assert reg.name == "kernelarc.rmsnorm.cpu"
    assert reg.champion() is None
    cand = candidate()
    v, run_id = logged(tracker, cand)
    info = collect_versions_info(gpu_name="test-cpu")
    version = reg.register(cand, v, run_id, info)
    assert version == 1

    mv = tracker.client.get_model_version(reg.name, "1")
    assert mv.run_id == run_id
    assert mv.source == tracker.artifact_uri(run_id) + "/kernel"

    loaded = reg.load_kernel(version)
    assert loaded == cand and loaded.id == cand.id
    assert reg.load_kernel("1") == cand

    # Runnable: import the registered kernel.py and compare with the reference on CPU tensors.
    path = reg.materialize(version, workdir / "kernel_v1")
    assert path.name == "kernel.py" and path.read_text() == cand.source
    module = import_kernel(path)
    x = torch.randn(7, 37)
    w = torch.randn(37)
    torch.testing.assert_close(module.run(x, w), reference(x, w))

    # The same through the candidate object (what a worker receives).
    ns: dict = {}
    exec(compile(loaded.source, "<registered>", "exec"), ns)
    torch.testing.assert_close(ns["run"](x, w), reference(x, w))


def test_version_tags_hold_metrics_and_versions(tracker, monkeypatch):
    monkeypatch.setenv("ANTHROPIC_API_KEY", SECRET)
    reg = Registry(tracker, TASK, GPU)
    cand = candidate(rationale=f"the key is {SECRET}")
    v, run_id = logged(tracker, cand)
    version = reg.register(cand, v, run_id, collect_versions_info(gpu_name="NVIDIA H200", cuda="13.0"))
    tags = reg.version_tags(version)
    assert tags["latency_ms"] == "0.5"
    assert tags["speedup_vs_baseline"] == "1.8"
    assert tags["sol_fraction"] == "0.7"
    assert tags["sol_score"] == "0.8"
    assert tags["tbps"] == "2.5"
    assert "tflops" not in tags
    assert tags["candidate_id"] == cand.id
    assert tags["language"] == "pytorch"
    assert tags["gpu"] == GPU
    assert tags["gpu_name"] == "NVIDIA H200"
    assert tags["cuda"] == "13.0"
    assert tags["torch"] == torch.__version__
    assert tags["python"].count(".") == 2
    assert "triton" in tags  # installed here; read from package metadata, not imported
    assert tags["knobs"] == '{"BLOCK": 256}'
    mv = tracker.client.get_model_version(reg.name, str(version))
    assert SECRET not in (mv.description or "")
    assert all(SECRET not in value for value in tags.values())
    assert reg.version_for(cand.id) == version
    assert reg.version_for("nope") is None


def test_promote_rules(tracker):
    reg = Registry(tracker, TASK, GPU)
    c1, c2, c3 = candidate("1"), candidate("2"), candidate("3")
    v1 = reg.register(c1, *logged(tracker, c1))
    v2 = reg.register(c2, *logged(tracker, c2))
    v3 = reg.register(c3, *logged(tracker, c3))
    assert reg.versions() == [v1, v2, v3]
    assert reg.champion() is None

    # The first champion has nothing to beat.
    assert reg.promote(v1, beat_champion=False) is True
    assert reg.champion_version() == v1
    # A version that did not beat the champion side by side does not move the alias.
    assert reg.promote(v2, beat_champion=False) is False
    assert reg.champion_version() == v1
    # One that did, does.
    assert reg.promote(v2, beat_champion=True) is True
    version, champ, tags = reg.champion()
    assert version == v2 and champ == c2 and tags["candidate_id"] == c2.id
    assert "kernelarc.promoted_at" in tags
    # Re-promoting the current champion is a no-op success.
    assert reg.promote(v2, beat_champion=False) is True
    assert reg.promote(v3, beat_champion=False) is False
    assert reg.champion_version() == v2

    # The alias resolves through the standard models:/ URI too.
    assert reg.load_kernel(f"models:/{reg.name}@champion") == c2
    assert reg.load_kernel("champion") == c2
    assert reg.load_kernel(f"models:/{reg.name}/{v1}") == c1
    assert int(tracker.client.get_model_version_by_alias(reg.name, "champion").version) == v2

    # set_champion records without checks (the caller owns the rule).
    reg.set_champion(v3)
    assert reg.champion_version() == v3


def test_register_refuses_bad_input(tracker):
    reg = Registry(tracker, TASK, GPU)
    good = candidate()
    bad = Verdict(candidate_id=good.id, status=Status.incorrect)
    _, run_id = logged(tracker, good, bad)
    with pytest.raises(ValueError, match="incorrect"):
        reg.register(good, bad, run_id, {})
    other = candidate("other")
    with pytest.raises(ValueError, match="verdict is for"):
        reg.register(other, verdict(good), run_id, {})
    with pytest.raises(ValueError, match="run_id"):
        reg.register(good, verdict(good), "", {})


def test_lookups_and_constructors(tracker):
    reg = Registry(tracker.client, TASK, GPU)
    with pytest.raises(LookupError):
        reg.load_kernel(42)
    with pytest.raises(LookupError):
        reg.load_kernel("champion")
    with pytest.raises(TypeError):
        reg.load_kernel(1.5)
    with pytest.raises(ValueError):
        reg.load_kernel("models:/bad uri")
    with pytest.raises(TypeError):
        Registry(object(), TASK, GPU)

    cand = candidate()
    version = reg.register(cand, *logged(tracker, cand))
    # A registry opened from the URI alone (another process, e.g. the export CLI) sees it.
    reg2 = Registry(tracker.uri, TASK, GPU)
    assert reg2.promote(version, beat_champion=False)
    assert reg2.champion()[1] == cand
    # Default URI: the working directory's mlflow.db.
    assert Registry(None, TASK, GPU).champion_version() == version
    # Another GPU is another model with its own champion.
    assert Registry(tracker, TASK, "h200").champion() is None


def test_every_version_loads_as_an_mlflow_pyfunc_model(tracker, workdir, monkeypatch):
    """models:/<name>@champion through mlflow.pyfunc, as any MLflow user loads a model; predict runs the
    registered kernel on torch tensors given in definition order (or by name) on a real task."""
    import mlflow

    from kernelarc.tasks.inputs import make_inputs
    from kernelarc.tasks.loader import load_builtin

    problem = load_builtin("rmsnorm", cpu=True)
    reg = Registry(tracker, TASK, GPU, problem=problem)
    cand = candidate()
    version = reg.register(cand, *logged(tracker, cand))
    reg.promote(version, beat_champion=False)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", tracker.uri)
    monkeypatch.setenv("MLFLOW_REGISTRY_URI", tracker.uri)

    model = mlflow.pyfunc.load_model(f"models:/{reg.name}@champion")
    meta = model.metadata.metadata
    assert meta["candidate_id"] == cand.id and meta["model"] == reg.name
    assert [i["name"] for i in meta["inputs"]] == ["x", "weight"] and meta["inputs"][0]["dtype"] == "bfloat16"
    x, w = make_inputs(problem, 0, 7, "cpu")  # bf16 tensors of the CPU workload
    expected = reference(x.double(), w.double())
    torch.testing.assert_close(model.predict([x, w]).double(), expected, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(model.predict({"weight": w, "x": x}), model.predict((x, w)))
    with pytest.raises(ValueError, match="expected 2 inputs"):
        model.predict([x])
    with pytest.raises(ValueError, match="missing"):
        model.predict({"x": x})
    # The input example rides along: the smallest workload's inputs, loadable and runnable.
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{reg.name}/{version}", dst_path=str(workdir / "m")))
    example = torch.load(local / meta["input_example"]["file"])
    assert [tuple(t.shape) for t in example] == [tuple(x.shape) for x in make_inputs(problem, 0, 0, "cpu")]
    assert model.predict(example).shape == example[0].shape
    assert (local / "definition.json").is_file() and (local / "kernel.py").read_text() == cand.source
    # Export still reads the kernel back from the same folder.
    assert reg.load_kernel("champion") == cand


def test_a_kernel_registered_again_keeps_its_version(tracker):
    """The reference baseline is judged (and crowned first) in every session: one version, not one per session."""
    reg = Registry(tracker, TASK, GPU)
    cand = candidate()
    first = reg.register(cand, *logged(tracker, cand))
    again = reg.register(cand, *logged(tracker, cand))  # a later session's child run of the same kernel
    assert again == first and reg.versions() == [first]
    other = candidate("other")
    assert reg.register(other, *logged(tracker, other)) == first + 1


def test_signature_only_where_numpy_holds_the_dtypes():
    from kernelarc.registry import _signature

    fp32 = {
        "inputs": {"x": {"shape": ["M", 4], "dtype": "float32"}},
        "outputs": {"y": {"shape": ["M"], "dtype": "float32"}},
    }
    sig = _signature(fp32)
    assert sig.inputs.input_names() == ["x"] and sig.inputs.inputs[0].shape == (-1, 4)
    assert _signature({**fp32, "outputs": {"y": {"shape": ["M"], "dtype": "bfloat16"}}}) is None
