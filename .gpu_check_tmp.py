import json, os, sys, time, warnings
sys.path.insert(0, os.getcwd())
import torch
from kernelarc import hardware as hw
from kernelarc.sol import count_work, t_sol, sol_terms
out = {}
t = hw.resolve_target("auto")
out["auto"] = t.name
out["device"] = torch.cuda.get_device_name(0)
for name in ("b200", "h100"):
    try:
        hw.resolve_target(name); out[name] = "NO ERROR"
    except hw.HardwareMismatch as e:
        out[name] = "HardwareMismatch: " + str(e)
t0 = time.time()
res = hw.calibrate(t)
out["calibrate_s"] = round(time.time() - t0, 2)
out["calibrate"] = res
out["calibrated"] = t.calibrated
out["peak_bf16_after"] = hw.peak(t, "bfloat16") / 1e12
out["bw_after"] = hw.bandwidth(t) / 1e12
# counting on CUDA: matmul, SDPA (flash/cudnn op in registry), rmsnorm
dev = "cuda"
a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
w = count_work(lambda x, y: x @ y.T, [a, a])
out["mm"] = (w.tc_flops, w.io_bytes)
q = torch.randn(2, 8, 1024, 128, device=dev, dtype=torch.bfloat16)
k = torch.randn(2, 2, 1024, 128, device=dev, dtype=torch.bfloat16)
w = count_work(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), [q, k, k])
out["sdpa_gqa"] = (w.tc_flops, w.simt_flops, w.ops, 4 * 2 * 8 * 1024 * 1024 * 128)
x = torch.randn(8192, 4096, device=dev, dtype=torch.bfloat16)
g = torch.randn(4096, device=dev, dtype=torch.bfloat16)
w = count_work(lambda x, g: torch.nn.functional.rms_norm(x, (4096,), g), [x, g])
out["rms_norm"] = (w.tc_flops, w.simt_flops, w.io_bytes, w.ops, t_sol(w, hw.KNOWN_TARGETS["h200"]))
# sanity: timed torch matmul vs SOL on this device
import statistics
def bench(fn, n=20):
    for _ in range(3): fn()
    torch.cuda.synchronize(); ts=[]
    for _ in range(n):
        s=torch.cuda.Event(enable_timing=True); e=torch.cuda.Event(enable_timing=True)
        s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e)/1e3)
    return statistics.median(ts)
b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
w = count_work(torch.matmul, [b, b])
tk = bench(lambda: torch.matmul(b, b))
out["mm8192"] = {"t_k_ms": tk*1e3, "t_sol_datasheet_ms": t_sol(w, hw.KNOWN_TARGETS["h200"])[0]*1e3, "t_sol_calibrated_ms": t_sol(w, t)[0]*1e3}
print(json.dumps(out, indent=1, default=str))
