"""GPU targets: the ceilings of the speed-of-light model, detection and calibration.

A :class:`GpuTarget` holds datasheet ceilings (dense tensor-core and SIMT FLOP/s per dtype,
HBM bandwidth, a few sizes) plus optional measured values in ``calibrated``. It is a plain
dataclass with simple field types, so it also serves as the Hydra structured-config schema
of the ``gpu`` group (the YAML files in ``conf/gpu/`` hold the same fields).

Units in the dataclass: TFLOP/s (1e12) for rates, TB/s (1e12 B/s) for bandwidth, MB (1e6 B)
for L2, KB (1024 B) for shared memory, GB (1e9 B) for device memory. The accessors
:func:`peak` and :func:`bandwidth` return plain FLOP/s and B/s.

Sources of the numbers (dense, i.e. half the "with sparsity" datasheet figures):

* ``h100`` -- NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP64 34, FP64 tensor
  67, FP32 67, TF32 989 / BF16 1979 / FP16 1979 / FP8 3958 / INT8 3958 (sparse), HBM3
  3.35 TB/s, 80 GB. 132 SMs, 50 MB L2, 228 KB shared memory per SM (Hopper tuning guide).
  Non-tensor FP16/BF16: 2x FP32 (the Hopper whitepaper lists 133.8 TFLOP/s for SXM5).
* ``h200`` -- NVIDIA H200 datasheet, H200 SXM column: the same compute as H100 SXM, HBM3e
  4.8 TB/s, 141 GB; same die (132 SMs, 50 MB L2, 228 KB/SM).
* ``b200`` -- NVIDIA HGX B200 figures at 1000 W (NVIDIA Blackwell datasheet, as tabulated at
  https://glennklockwood.com/garden/processors/B200): FP64 40, FP32 80, TF32 1100 (dense),
  FP16/BF16 2250, FP8 4500, INT8 4500; HBM3e 8 TB/s, 192 GB. 148 SMs and 126.5 MB L2
  (129536 KiB) as reported by a B200's device query; 228 KB shared memory per SM
  (compute capability 10.0). Non-tensor FP16/BF16 assumed 2x FP32 (not on the datasheet).
* ``cpu`` -- deliberately modest placeholders for a small x86 server/desktop without AMX:
  1 TFLOP/s for every "matrix" dtype (bf16/fp16/fp8 computed through fp32 FMA units),
  2 TOP/s int8 (VNNI), 1 TFLOP/s SIMT fp32, 0.5 fp16/bf16/fp64, 50 GB/s DRAM. They only
  keep the roofline finite on CPU runs; :func:`calibrate` measures the real machine.
* :data:`SOLAR_B200` -- not a Hydra target: the B200 ceilings of NVIDIA SOLAR's
  ``configs/arch/B200.yaml`` (1.5 GHz x MACs/cycle: BF16/FP16 1811.25, FP8/INT8 3622.5,
  TF32 905.6 TFLOP/s, FP32 SIMT 80 TFLOP/s, DRAM 5111.6 B/cycle = 7.667 TB/s), i.e. what the
  SOL-ExecBench leaderboard's ``sol_ms`` were computed with. Use it to compare with them.
"""

from __future__ import annotations

import copy
import logging
import math
import re
import statistics
import time
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parent.parent / "conf" / "gpu"

# Canonical dtype keys of ``peak_tflops`` / ``simt_tflops``.
TC_DTYPES = ("bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float32", "int8", "float64")
SIMT_DTYPES = ("float32", "float16", "bfloat16", "float64")


class HardwareMismatch(RuntimeError):
    """The requested target is not the hardware that is present (or there is no GPU at all)."""


@dataclass
class GpuTarget:
    """Ceilings of one device. Rates in TFLOP/s, bandwidth in TB/s (see the module docstring).

    ``peak_tflops``: dense tensor-core rate per operand dtype; the ``float32`` entry is the TF32
    rate (fp32 operands on tensor cores). ``simt_tflops``: non-tensor FMA rates (FMA = 2 FLOPs).
    ``device_match``: substrings of ``torch.cuda.get_device_name`` that identify the device
    (matched at a word start, so ``"H200"`` does not match ``"GH200"``).
    ``calibrated``: measured ``copy_tbps`` and ``gemm_bf16_tflops`` (see :func:`calibrate`),
    preferred by :func:`peak` and :func:`bandwidth`; ``calibration_info`` says where and with
    what software they were measured.
    """

    name: str = "auto"
    arch: str = ""
    sm_count: int = 0
    peak_tflops: dict[str, float] = field(default_factory=dict)
    simt_tflops: dict[str, float] = field(default_factory=dict)
    hbm_tbps: float = 0.0
    l2_mb: float = 0.0
    smem_kb_per_sm: float = 0.0
    memory_gb: float = 0.0
    device_match: list[str] = field(default_factory=list)
    calibrated: dict[str, float] = field(default_factory=dict)
    calibration_info: dict[str, str] = field(default_factory=dict)
    source: str | None = None

    @property
    def is_cpu(self) -> bool:
        return self.arch == "cpu"

    def to_dict(self) -> dict[str, Any]:
        return {f.name: copy.deepcopy(getattr(self, f.name)) for f in fields(self)}


_HOPPER_TC = {
    "bfloat16": 989.5, "float16": 989.5, "float8_e4m3fn": 1979.0, "float8_e5m2": 1979.0,
    "float32": 494.5, "int8": 1979.0, "float64": 67.0,
}  # fmt: skip
_HOPPER_SIMT = {"float32": 67.0, "float16": 134.0, "bfloat16": 134.0, "float64": 34.0}

KNOWN_TARGETS: dict[str, GpuTarget] = {
    "h100": GpuTarget(
        name="h100", arch="sm_90a", sm_count=132,
        peak_tflops=dict(_HOPPER_TC), simt_tflops=dict(_HOPPER_SIMT),
        hbm_tbps=3.35, l2_mb=50.0, smem_kb_per_sm=228.0, memory_gb=80.0,
        device_match=["H100 80GB HBM3", "H100 SXM"],
        source="NVIDIA H100 datasheet (SXM, dense)",
    ),
    "h200": GpuTarget(
        name="h200", arch="sm_90a", sm_count=132,
        peak_tflops=dict(_HOPPER_TC), simt_tflops=dict(_HOPPER_SIMT),
        hbm_tbps=4.8, l2_mb=50.0, smem_kb_per_sm=228.0, memory_gb=141.0,
        device_match=["H200"],
        source="NVIDIA H200 datasheet (SXM, dense)",
    ),
    "b200": GpuTarget(
        name="b200", arch="sm_100a", sm_count=148,
        peak_tflops={
            "bfloat16": 2250.0, "float16": 2250.0, "float8_e4m3fn": 4500.0, "float8_e5m2": 4500.0,
            "float32": 1100.0, "int8": 4500.0, "float64": 40.0,
        },
        simt_tflops={"float32": 80.0, "float16": 160.0, "bfloat16": 160.0, "float64": 40.0},
        hbm_tbps=8.0, l2_mb=126.5, smem_kb_per_sm=228.0, memory_gb=192.0,
        device_match=["B200"],
        source="NVIDIA HGX B200 1000 W figures (dense), via glennklockwood.com/garden/processors/B200",
    ),
    "cpu": GpuTarget(
        name="cpu", arch="cpu", sm_count=0,
        peak_tflops={
            "bfloat16": 1.0, "float16": 1.0, "float8_e4m3fn": 1.0, "float8_e5m2": 1.0,
            "float32": 1.0, "int8": 2.0, "float64": 0.5,
        },
        simt_tflops={"float32": 1.0, "float16": 0.5, "bfloat16": 0.5, "float64": 0.5},
        hbm_tbps=0.05, l2_mb=2.0, smem_kb_per_sm=0.0, memory_gb=0.0,
        device_match=[],
        source="placeholder for a modest CPU (no AMX); run calibrate() for real numbers",
    ),
}  # fmt: skip

# The B200 ceilings NVIDIA SOLAR used for the SOL-ExecBench leaderboard (configs/arch/B200.yaml:
# freq 1.5 GHz, MAC_per_cycle_{bf16,fp16}_tc 603751, fp8/int8 1207501, tf32 301875,
# fp32_sm 26667, DRAM_byte_per_cycle 5111.6). FLOP/s = 2 * MACs/cycle * 1.5e9.
SOLAR_B200 = GpuTarget(
    name="b200_solar", arch="sm_100a", sm_count=148,
    peak_tflops={
        "bfloat16": 1811.253, "float16": 1811.253, "float8_e4m3fn": 3622.503, "float8_e5m2": 3622.503,
        "float32": 905.625, "int8": 3622.5, "float64": 40.0,
    },
    simt_tflops={"float32": 80.001, "float16": 160.002, "bfloat16": 160.002, "float64": 40.0},
    hbm_tbps=7.6674, l2_mb=126.5, smem_kb_per_sm=228.0, memory_gb=192.0,
    device_match=["B200"],
    source="NVlabs/SOLAR configs/arch/B200.yaml (SOL-ExecBench leaderboard ceilings)",
)  # fmt: skip

_DTYPE_ALIASES = {
    "bf16": "bfloat16", "bfloat16": "bfloat16", "fp16": "float16", "half": "float16", "float16": "float16",
    "fp32": "float32", "float": "float32", "float32": "float32", "tf32": "float32",
    "fp64": "float64", "double": "float64", "float64": "float64",
    "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn", "float8_e4m3fn": "float8_e4m3fn",
    "float8_e4m3fnuz": "float8_e4m3fn", "e5m2": "float8_e5m2", "float8_e5m2": "float8_e5m2",
    "float8_e5m2fnuz": "float8_e5m2", "int8": "int8", "uint8": "int8", "i8": "int8",
}  # fmt: skip

# Where a dtype has no entry of its own, the rate of the next one in its chain is used.
_TC_FALLBACK = {
    "float8_e5m2": ["float8_e4m3fn", "float16", "bfloat16"],
    "float8_e4m3fn": ["float8_e5m2", "float16", "bfloat16"],
    "bfloat16": ["float16"],
    "float16": ["bfloat16"],
    "int8": ["float8_e4m3fn", "float16"],
    "float32": ["float16"],
}


def dtype_key(dtype: Any) -> str:
    """Canonical dtype name (``torch.bfloat16``, ``"bf16"`` -> ``"bfloat16"``; ``"tf32"`` -> ``"float32"``)."""
    s = str(dtype).removeprefix("torch.").lower()
    return _DTYPE_ALIASES.get(s, s)


# --------------------------------------------------------------------------- ceilings


def peak(target: GpuTarget, dtype: Any, tensor_core: bool = True) -> float:
    """Ceiling in FLOP/s for ``dtype`` on tensor cores (``tensor_core=True``) or on SIMT units.

    Precedence: with ``calibrated["gemm_bf16_tflops"]`` present, tensor-core bf16/fp16 use the
    measured rate and every other tensor-core dtype is its datasheet rate scaled by the same
    measured/datasheet ratio (the clocks and power that limit bf16 limit them too). Without
    it, the datasheet value. SIMT rates are always the datasheet's. A missing tensor-core
    dtype falls back along ``_TC_FALLBACK`` (e.g. fp8 -> fp16); integer, bool and fp8 SIMT work
    is priced at the fp32 rate; a tensor-core dtype with no rate at all (int32...) falls back
    to the SIMT rate.
    """
    key = dtype_key(dtype)
    if tensor_core:
        rate = _lookup(target.peak_tflops, key, _TC_FALLBACK.get(key, []))
        if rate is None:
            return peak(target, key, tensor_core=False)
        measured = target.calibrated.get("gemm_bf16_tflops")
        if measured:
            sheet_bf16 = _lookup(target.peak_tflops, "bfloat16", ["float16"])
            exact = key in ("bfloat16", "float16") or not sheet_bf16
            rate = measured if exact else rate * measured / sheet_bf16  # type: ignore[operator]
        return rate * 1e12
    simt_key = key if key in SIMT_DTYPES else "float32"
    rate = _lookup(target.simt_tflops, simt_key, ["float32"])
    if rate is None:
        raise ValueError(
            f"target {target.name!r} has no SIMT rate for {key!r} (simt_tflops={target.simt_tflops}); "
            "fill it in the target's YAML or run calibrate()"
        )
    return rate * 1e12


def bandwidth(target: GpuTarget) -> float:
    """DRAM bandwidth in B/s: ``calibrated["copy_tbps"]`` (measured copy) if present, else ``hbm_tbps``."""
    tbps = target.calibrated.get("copy_tbps") or target.hbm_tbps
    if not tbps or tbps <= 0:
        raise ValueError(f"target {target.name!r} has no bandwidth (hbm_tbps=0 and not calibrated); run calibrate()")
    return tbps * 1e12


def _lookup(table: Mapping[str, float], key: str, chain: list[str]) -> float | None:
    for k in [key, *chain]:
        v = table.get(k)
        if v:
            return float(v)
    return None


# --------------------------------------------------------------------------- resolution


def _name_matches(device_name: str, pattern: str) -> bool:
    return re.search(r"(?<![A-Za-z0-9])" + re.escape(pattern), device_name, flags=re.IGNORECASE) is not None


def match_device(device_name: str, targets: Mapping[str, GpuTarget] | None = None) -> GpuTarget | None:
    """The known target whose ``device_match`` fits ``device_name`` (longest pattern wins), or None."""
    best, best_len = None, -1
    for t in (targets or KNOWN_TARGETS).values():
        for pat in t.device_match:
            if _name_matches(device_name, pat) and len(pat) > best_len:
                best, best_len = t, len(pat)
    return copy.deepcopy(best) if best is not None else None


def _cuda_device_name(device: Any = None) -> str | None:
    import torch

    if not torch.cuda.is_available():
        return None
    idx = _cuda_index(device)
    return torch.cuda.get_device_name(idx)


def _cuda_index(device: Any) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    if d.type != "cuda":
        raise ValueError(f"not a CUDA device: {device!r}")
    return d.index if d.index is not None else torch.cuda.current_device()


# Dense bf16 tensor-core FLOPs per SM per clock by compute-capability major (used only to
# estimate an unknown GPU): Volta/Turing 1024, Ampere 2048 (A100), Hopper 4096, Blackwell 8192.
_TC_FLOPS_PER_SM_CLK = {7: 1024, 8: 2048, 9: 4096, 10: 8192, 12: 2048}


def target_from_properties(device: Any = None) -> GpuTarget:
    """A rough target for an unknown CUDA GPU, from ``torch.cuda.get_device_properties``.

    Bandwidth from the memory clock and bus width when torch exposes them, compute from SM
    count x clock x a per-architecture FLOPs/clock estimate. These are estimates: run
    :func:`calibrate` before trusting a speed-of-light number on such a GPU.
    """
    import torch

    idx = _cuda_index(device)
    p = torch.cuda.get_device_properties(idx)
    major, minor = int(p.major), int(p.minor)
    sms = int(p.multi_processor_count)
    clock_ghz = (getattr(p, "clock_rate", 0) or 0) / 1e6 or 1.5  # kHz -> GHz; guess 1.5 GHz
    tc = sms * clock_ghz * 1e9 * _TC_FLOPS_PER_SM_CLK.get(major, 2048) / 1e12
    fp32 = sms * clock_ghz * 1e9 * 128 * 2 / 1e12
    mem_khz = getattr(p, "memory_clock_rate", 0) or 0
    bus_bits = getattr(p, "memory_bus_width", 0) or 0
    hbm = 2 * mem_khz * 1e3 * bus_bits / 8 / 1e12 if mem_khz and bus_bits else 1.0
    smem = getattr(p, "shared_memory_per_multiprocessor", 0) or 0
    l2 = getattr(p, "L2_cache_size", 0) or 0
    arch = f"sm_{major}{minor}" + ("a" if major in (9, 10) else "")
    return GpuTarget(
        name=re.sub(r"[^a-z0-9]+", "_", p.name.lower()).strip("_"),
        arch=arch,
        sm_count=sms,
        peak_tflops={
            "bfloat16": tc, "float16": tc, "float8_e4m3fn": 2 * tc if major >= 9 else tc,
            "float8_e5m2": 2 * tc if major >= 9 else tc, "float32": tc / 2, "int8": 2 * tc,
        },
        simt_tflops={"float32": fp32, "float16": 2 * fp32, "bfloat16": 2 * fp32, "float64": fp32 / 2},
        hbm_tbps=hbm,
        l2_mb=l2 / 1e6,
        smem_kb_per_sm=smem / 1024,
        memory_gb=p.total_memory / 1e9,
        device_match=[p.name.removeprefix("NVIDIA ").strip()],
        source=f"estimated from torch device properties of {p.name!r}; calibrate() before trusting it",
    )  # fmt: skip


def _from_mapping(cfg: Mapping[str, Any]) -> GpuTarget:
    try:
        from omegaconf import DictConfig, OmegaConf

        if isinstance(cfg, DictConfig):
            cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    except ImportError:  # pragma: no cover - omegaconf is a dependency
        pass
    known = {f.name for f in fields(GpuTarget)}
    unknown = set(cfg) - known
    if unknown:
        raise ValueError(f"gpu config has unknown fields {sorted(unknown)}; known: {sorted(known)}")
    kwargs = {k: copy.deepcopy(v) for k, v in cfg.items() if v is not None}
    for k in ("peak_tflops", "simt_tflops", "calibrated"):
        if k in kwargs:
            kwargs[k] = {str(a): float(b) for a, b in (kwargs[k] or {}).items()}
    if "device_match" in kwargs:
        kwargs["device_match"] = [str(x) for x in kwargs["device_match"] or []]
    return GpuTarget(**kwargs)


def resolve_target(
    name_or_cfg: str | GpuTarget | Mapping[str, Any] | None = "auto",
    *,
    allow_missing: bool = False,
    device: Any = None,
) -> GpuTarget:
    """The target to measure against, checked against the hardware that is present.

    ``name_or_cfg``: ``"auto"``, a known name (``h100``, ``h200``, ``b200``, ``cpu``), a
    :class:`GpuTarget`, or a mapping/DictConfig of its fields (a ``gpu`` config group node;
    ``name: auto`` there means detect).

    * ``auto``: CUDA available -> the known target matching the device name; an unknown GPU
      -> :func:`target_from_properties` with a warning; no GPU -> ``cpu``.
    * A GPU target while a different GPU is present -> :class:`HardwareMismatch`.
    * A GPU target with no GPU present -> :class:`HardwareMismatch`, unless
      ``allow_missing=True`` (CPU tests, ahead-of-time compilation), which returns it as is.
    * ``cpu`` is always allowed.

    Returns a fresh copy: callers may store calibration in it.
    """
    if name_or_cfg is None:
        name_or_cfg = "auto"
    if isinstance(name_or_cfg, GpuTarget):
        target = copy.deepcopy(name_or_cfg)
    elif isinstance(name_or_cfg, str):
        key = name_or_cfg.strip().lower()
        if key == "auto":
            return _detect(device)
        if key not in KNOWN_TARGETS:
            raise ValueError(f"unknown gpu target {name_or_cfg!r}; known: auto, {', '.join(KNOWN_TARGETS)}")
        target = copy.deepcopy(KNOWN_TARGETS[key])
    elif isinstance(name_or_cfg, Mapping) or hasattr(name_or_cfg, "keys"):
        name = str(name_or_cfg.get("name", "") or "").lower()  # type: ignore[union-attr]
        if name in ("", "auto"):
            return _detect(device)
        target = _from_mapping(name_or_cfg)  # type: ignore[arg-type]
    else:
        raise TypeError(f"resolve_target: expected a name, GpuTarget or mapping, got {type(name_or_cfg).__name__}")
    check_target(target, allow_missing=allow_missing, device=device)
    return target


def check_target(target: GpuTarget, *, allow_missing: bool = False, device: Any = None) -> None:
    """Raise :class:`HardwareMismatch` unless ``target`` describes the present hardware."""
    if target.is_cpu:
        return
    present = _cuda_device_name(device)
    if present is None:
        if allow_missing:
            log.info("gpu target %s requested without a GPU; allowed (allow_missing=True)", target.name)
            return
        raise HardwareMismatch(
            f"gpu target {target.name!r} ({target.arch}) was requested but no CUDA GPU is available. "
            "Use gpu=cpu (or gpu=auto) on this machine, or pass allow_missing=True for CPU tests and "
            "ahead-of-time compilation."
        )
    if not target.device_match:
        warnings.warn(
            f"gpu target {target.name!r} has no device_match; cannot verify it against the present GPU {present!r}",
            stacklevel=3,
        )
        return
    if not any(_name_matches(present, pat) for pat in target.device_match):
        found = match_device(present)
        hint = f"gpu={found.name} or gpu=auto" if found else "gpu=auto"
        raise HardwareMismatch(
            f"gpu target {target.name!r} (matches {target.device_match}) was requested, but the GPU "
            f"present is {present!r}. Speed-of-light numbers would describe the wrong device; use {hint}."
        )


def _detect(device: Any = None) -> GpuTarget:
    present = _cuda_device_name(device)
    if present is None:
        return copy.deepcopy(KNOWN_TARGETS["cpu"])
    found = match_device(present)
    if found is not None:
        return found
    t = target_from_properties(device)
    warnings.warn(
        f"unknown GPU {present!r}: using ceilings estimated from its properties "
        f"({t.peak_tflops['bfloat16']:.0f} bf16 TFLOP/s, {t.hbm_tbps:.2f} TB/s); run calibrate() "
        "or add a conf/gpu YAML for it",
        stacklevel=3,
    )
    return t


def load_target_yaml(name: str) -> GpuTarget:
    """Read ``conf/gpu/<name>.yaml`` into a target (no hardware check)."""
    import yaml  # pyyaml comes with hydra/omegaconf

    path = CONF_DIR / f"{name}.yaml"
    data = yaml.safe_load(path.read_text()) or {}
    if "defaults" in data:
        data = {k: v for k, v in data.items() if k != "defaults"}
    return _from_mapping(data)


# --------------------------------------------------------------------------- calibration


def _versions() -> dict[str, str]:
    import torch

    info = {"torch_version": torch.__version__}
    try:
        import triton

        info["triton_version"] = triton.__version__
    except Exception:  # pragma: no cover - triton is a dependency
        info["triton_version"] = "absent"
    return info


def calibrate(target: GpuTarget, device: Any = None, *, quick: bool = False) -> dict[str, Any]:
    """Measure copy bandwidth and bf16 GEMM rate on ``device``; store them in ``target``.

    GPU: device-to-device ``copy_`` of a buffer of at least 1 GiB and 8x the L2 (so the L2
    cannot hold it), counting bytes read + written, timed with CUDA events, median of 30;
    bf16 ``torch.matmul`` of 8192^3 on random normal data (never zeros), median of 20.
    CPU: the same with a 64 MiB copy and 512^3 bf16 matmul timed with ``perf_counter``
    (well under 2 s). ``quick`` shrinks the GPU sizes (for smoke tests only).

    The measured ``copy_tbps`` and ``gemm_bf16_tflops`` go to ``target.calibrated`` (used by
    :func:`peak` / :func:`bandwidth` from then on); the device name, driver (from
    ``/proc/driver/nvidia/version``), CUDA runtime, torch and triton versions and the sizes
    measured go to ``target.calibration_info`` as strings. Returns all of them in one dict.
    """
    import torch

    dev = torch.device(device if device is not None else ("cpu" if target.is_cpu else "cuda"))
    if dev.type == "cuda":
        check_target(target, device=dev)
        result = _calibrate_cuda(target, dev, quick=quick)
    elif dev.type == "cpu":
        if not target.is_cpu:
            raise HardwareMismatch(f"cannot calibrate gpu target {target.name!r} on the CPU")
        result = _calibrate_cpu()
    else:
        raise ValueError(f"calibrate: unsupported device {dev}")
    numbers = {k: float(v) for k, v in result.items() if isinstance(v, (int, float))}
    info = {k: str(v) for k, v in result.items() if not isinstance(v, (int, float))}
    target.calibrated.update(numbers)
    target.calibration_info.update(info)
    return result


def _calibrate_cpu() -> dict[str, Any]:
    import platform

    import torch

    n = 64 * 2**20 // 4
    src = torch.randn(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        t0 = time.perf_counter()
        dst.copy_(src)
        dt = time.perf_counter() - t0
        if i >= 2:
            times.append(dt)
    copy_tbps = 2 * src.numel() * 4 / statistics.median(times) / 1e12
    m = 512
    a = torch.randn(m, m, dtype=torch.bfloat16)
    b = torch.randn(m, m, dtype=torch.bfloat16)
    times = []
    for i in range(7):
        t0 = time.perf_counter()
        c = torch.matmul(a, b)
        dt = time.perf_counter() - t0
        if i >= 2:
            times.append(dt)
    assert torch.count_nonzero(c) > 0
    gemm = 2 * m**3 / statistics.median(times) / 1e12
    return {
        "copy_tbps": copy_tbps,
        "gemm_bf16_tflops": gemm,
        "copy_bytes": str(2 * src.numel() * 4),
        "gemm_shape": f"{m}x{m}x{m} bfloat16",
        "device_name": platform.processor() or platform.machine(),
        "torch_threads": str(torch.get_num_threads()),
        **_versions(),
    }


def _cuda_events_median(fn, reps: int, warmup: int) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s = torch.cuda.Event(enable_timing=True)
        e = torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return statistics.median(times)


def _measure_copy(dev: Any, nbytes: int) -> tuple[float, int]:
    """(seconds per copy, bytes read + written) of a device-to-device copy of ``nbytes``."""
    import torch

    n = nbytes // 2
    src = torch.randn(n, device=dev, dtype=torch.float32).to(torch.bfloat16)
    dst = torch.empty_like(src)
    secs = _cuda_events_median(lambda: dst.copy_(src), reps=30, warmup=5)
    return secs, 2 * n * 2


def _measure_gemm(dev: Any, m: int) -> float:
    """Seconds per bf16 ``m^3`` matmul on random normal data (output checked non-zero)."""
    import torch

    a = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    b = torch.randn(m, m, device=dev, dtype=torch.bfloat16)
    out = torch.empty(m, m, device=dev, dtype=torch.bfloat16)
    secs = _cuda_events_median(lambda: torch.matmul(a, b, out=out), reps=20, warmup=5)
    if not bool(torch.isfinite(out).all()) or int(torch.count_nonzero(out)) == 0:
        raise RuntimeError("calibrate: GEMM produced non-finite or all-zero output")
    return secs


def _calibrate_cuda(target: GpuTarget, dev: Any, *, quick: bool = False) -> dict[str, Any]:
    import torch

    idx = _cuda_index(dev)
    props = torch.cuda.get_device_properties(idx)
    l2 = getattr(props, "L2_cache_size", 0) or int(target.l2_mb * 1e6)
    nbytes = max(2**30, 8 * l2) if not quick else max(64 * 2**20, 4 * l2)
    free, _total = torch.cuda.mem_get_info(idx)
    if 2 * nbytes > 0.8 * free:
        smaller = int(0.4 * free) // 2**20 * 2**20
        if smaller < 4 * l2:
            raise RuntimeError(f"calibrate: only {free / 2**30:.1f} GiB free, too little for an L2-excluding copy")
        warnings.warn(f"calibrate: {free / 2**30:.1f} GiB free; copying {smaller / 2**30:.2f} GiB", stacklevel=3)
        nbytes = smaller
    m = 8192 if not quick else 2048
    with torch.cuda.device(idx):
        t_copy, moved = _measure_copy(dev, nbytes)
        torch.cuda.empty_cache()
        t_gemm = _measure_gemm(dev, m)
        torch.cuda.empty_cache()
    copy_tbps = moved / t_copy / 1e12
    gemm = 2 * m**3 / t_gemm / 1e12
    result: dict[str, Any] = {
        "copy_tbps": copy_tbps,
        "gemm_bf16_tflops": gemm,
        "copy_bytes": str(moved),
        "gemm_shape": f"{m}x{m}x{m} bfloat16",
        "device_name": props.name,
        "cuda_runtime": str(torch.version.cuda),
        "driver_version": "unknown",
        **_versions(),
    }
    try:  # the kernel driver's own version (e.g. 580.65.06), from the Linux driver's proc file
        text = Path("/proc/driver/nvidia/version").read_text()
        found = re.search(r"Kernel Module(?: for \S+)?\s+([0-9][0-9.]+)", text)
        if found:
            result["driver_version"] = found.group(1)
    except OSError:
        pass
    if not math.isfinite(copy_tbps) or not math.isfinite(gemm):
        raise RuntimeError(f"calibrate: non-finite measurement {result}")
    return result


__all__ = [
    "CONF_DIR",
    "KNOWN_TARGETS",
    "SOLAR_B200",
    "GpuTarget",
    "HardwareMismatch",
    "bandwidth",
    "calibrate",
    "check_target",
    "dtype_key",
    "load_target_yaml",
    "match_device",
    "peak",
    "resolve_target",
    "target_from_properties",
]
