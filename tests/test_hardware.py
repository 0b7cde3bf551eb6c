"""GPU targets: numbers, YAML mirror, detection, mismatch errors, ceilings, CPU calibration."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from kernelarc import hardware as hw
from kernelarc.hardware import (
    CONF_DIR,
    KNOWN_TARGETS,
    GpuTarget,
    HardwareMismatch,
    bandwidth,
    calibrate,
    load_target_yaml,
    peak,
    resolve_target,
)


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def fake_gpu(monkeypatch, name: str, **props):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda idx=None: name)
    p = dict(
        name=name, major=9, minor=0, multi_processor_count=114, clock_rate=1_755_000,
        memory_clock_rate=1_593_000, memory_bus_width=5120, shared_memory_per_multiprocessor=233472,
        L2_cache_size=50 * 2**20, total_memory=80 * 10**9,
    )  # fmt: skip
    p.update(props)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda idx=None: SimpleNamespace(**p))


# --------------------------------------------------------------------------- numbers


def test_datasheet_numbers():
    h100, h200, b200 = KNOWN_TARGETS["h100"], KNOWN_TARGETS["h200"], KNOWN_TARGETS["b200"]
    assert peak(h200, "bfloat16") == pytest.approx(989.5e12)
    assert peak(h200, torch.float8_e4m3fn) == pytest.approx(1979e12)
    assert peak(h200, "tf32") == pytest.approx(494.5e12)
    assert h100.peak_tflops == h200.peak_tflops and h100.simt_tflops == h200.simt_tflops
    assert bandwidth(h100) == pytest.approx(3.35e12)
    assert bandwidth(h200) == pytest.approx(4.8e12)
    assert h200.memory_gb == 141 and h200.arch == "sm_90a"
    assert peak(b200, "bf16") == pytest.approx(2250e12)
    assert peak(b200, "fp8") == pytest.approx(4500e12)
    assert bandwidth(b200) == pytest.approx(8e12)
    assert b200.arch == "sm_100a"
    assert peak(b200, "float32", tensor_core=False) == pytest.approx(80e12)
    for t in KNOWN_TARGETS.values():
        assert set(hw.TC_DTYPES[:6]) <= set(t.peak_tflops), t.name
        assert set(hw.SIMT_DTYPES) <= set(t.simt_tflops), t.name
    assert KNOWN_TARGETS["cpu"].arch == "cpu"


def test_yaml_mirrors_python_targets():
    names = {p.stem for p in CONF_DIR.glob("*.yaml")}
    assert {"h100", "h200", "b200", "cpu", "auto"} <= names
    for name, target in KNOWN_TARGETS.items():
        assert load_target_yaml(name) == target, name
    auto = yaml.safe_load((CONF_DIR / "auto.yaml").read_text())
    assert auto["name"] == "auto" and not auto["peak_tflops"] and auto["hbm_tbps"] == 0
    field_names = {f.name for f in dataclasses.fields(GpuTarget)}
    for p in CONF_DIR.glob("*.yaml"):
        assert set(yaml.safe_load(p.read_text())) == field_names, p


def test_structured_config_roundtrip(no_gpu):
    schema = OmegaConf.structured(GpuTarget)
    cfg = OmegaConf.merge(schema, yaml.safe_load((CONF_DIR / "h200.yaml").read_text()))
    t = resolve_target(cfg, allow_missing=True)
    assert t == KNOWN_TARGETS["h200"]
    auto = OmegaConf.merge(schema, yaml.safe_load((CONF_DIR / "auto.yaml").read_text()))
    assert resolve_target(auto).name == "cpu"


# --------------------------------------------------------------------------- resolution


def test_auto_without_gpu_is_cpu(no_gpu):
    t = resolve_target("auto")
    assert t.name == "cpu" and t.is_cpu
    assert resolve_target(None).name == "cpu"
    assert resolve_target("cpu").name == "cpu"


def test_gpu_target_without_gpu_needs_allow_missing(no_gpu):
    with pytest.raises(HardwareMismatch, match="no CUDA GPU"):
        resolve_target("h200")
    t = resolve_target("h200", allow_missing=True)
    assert t.name == "h200"
    t.calibrated["copy_tbps"] = 1.0  # a copy: the registry is untouched
    assert KNOWN_TARGETS["h200"].calibrated == {}


def test_unknown_name():
    with pytest.raises(ValueError, match="unknown gpu target 'a100'"):
        resolve_target("a100")


def test_mismatch_on_h200(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H200")
    assert resolve_target("auto").name == "h200"
    assert resolve_target("h200").name == "h200"
    assert resolve_target("cpu").name == "cpu"
    with pytest.raises(HardwareMismatch) as e:
        resolve_target("b200")
    assert "NVIDIA H200" in str(e.value) and "gpu=h200" in str(e.value)
    with pytest.raises(HardwareMismatch):
        resolve_target("h100", allow_missing=True)  # allow_missing is about absence, not a wrong GPU


def test_device_names(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 80GB HBM3")
    assert resolve_target("auto").name == "h100"
    fake_gpu(monkeypatch, "NVIDIA B200")
    assert resolve_target("auto").name == "b200"
    assert hw.match_device("NVIDIA GH200 480GB") is None  # "H200" must not match inside "GH200"


def test_unknown_gpu_from_properties(monkeypatch):
    fake_gpu(monkeypatch, "NVIDIA H100 PCIe")
    with pytest.warns(UserWarning, match="unknown GPU"):
        t = resolve_target("auto")
    assert t.arch == "sm_90a" and t.sm_count == 114
    assert t.hbm_tbps == pytest.approx(2 * 1.593e9 * 640 / 1e12)  # ~2.04 TB/s, the PCIe card's
    assert 500 < t.peak_tflops["bfloat16"] < 1000
    assert t.device_match == ["H100 PCIe"]


# --------------------------------------------------------------------------- ceilings


def test_calibrated_values_are_preferred():
    t = resolve_target("h200", allow_missing=True)
    t.calibrated.update(copy_tbps=4.27, gemm_bf16_tflops=672.0)
    assert bandwidth(t) == pytest.approx(4.27e12)
    assert peak(t, "bfloat16") == pytest.approx(672e12)
    assert peak(t, "float16") == pytest.approx(672e12)
    assert peak(t, "float8_e4m3fn") == pytest.approx(1979e12 * 672 / 989.5)  # same derating
    assert peak(t, "float32", tensor_core=False) == pytest.approx(67e12)  # SIMT: datasheet


def test_fallbacks_and_aliases():
    t = GpuTarget(name="x", arch="sm_90a", peak_tflops={"float16": 100.0}, simt_tflops={"float32": 10.0}, hbm_tbps=1.0)
    assert peak(t, "bf16") == peak(t, torch.bfloat16) == pytest.approx(100e12)
    assert peak(t, "float8_e5m2") == pytest.approx(100e12)
    assert peak(t, "int32") == pytest.approx(10e12)  # no tensor-core rate: SIMT
    assert peak(t, "bool", tensor_core=False) == pytest.approx(10e12)
    with pytest.raises(ValueError, match="no bandwidth"):
        bandwidth(GpuTarget(name="y"))


def test_calibrate_cpu():
    t = resolve_target("cpu")
    res = calibrate(t, "cpu")
    # the CPU sizes are the small ones (its speed belongs in benchmarks, not in a timed unit test)
    assert res["copy_bytes"] == str(2 * 64 * 2**20) and res["gemm_shape"] == "512x512x512 bfloat16"
    assert res["copy_tbps"] > 0 and res["gemm_bf16_tflops"] > 0
    assert t.calibrated["copy_tbps"] == res["copy_tbps"]
    assert bandwidth(t) == pytest.approx(res["copy_tbps"] * 1e12)
    assert peak(t, "bfloat16") == pytest.approx(res["gemm_bf16_tflops"] * 1e12)
    assert t.calibration_info["torch_version"] == torch.__version__
    assert "triton_version" in t.calibration_info


def test_calibrate_refuses_wrong_device(no_gpu):
    t = resolve_target("h200", allow_missing=True)
    with pytest.raises(HardwareMismatch):
        calibrate(t, "cpu")
    with pytest.raises(HardwareMismatch):
        calibrate(t)  # no GPU present
