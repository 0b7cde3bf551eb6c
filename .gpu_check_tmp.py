import json, os, sys
sys.path.insert(0, os.getcwd())
import torch
from kernelarc import hardware as hw
from kernelarc.sol import count_work
out = {}
t = hw.resolve_target("auto")
out["calibrate"] = hw.calibrate(t); out["calibrated"] = t.calibrated; out["info"] = t.calibration_info
dev = "cuda"
for causal in (False, True):
    q = torch.randn(2, 8, 1024, 128, device=dev, dtype=torch.bfloat16)
    k = torch.randn(2, 2, 1024, 128, device=dev, dtype=torch.bfloat16)
    w = count_work(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True), [q, k, k])
    out[f"sdpa_gqa_causal{causal}"] = (w.tc_flops, w.simt_flops, w.ops, 4 * 2 * 8 * 1024 * 1024 * 128)
    q = torch.randn(2, 8, 1024, 64, device=dev, dtype=torch.float16)
    w = count_work(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=causal), [q])
    out[f"sdpa_fp16_causal{causal}"] = (w.tc_flops, w.ops, 4 * 2 * 8 * 1024 * 1024 * 64)
with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION):
    w = count_work(lambda q: torch.nn.functional.scaled_dot_product_attention(q, q, q), [q])
    out["sdpa_efficient"] = (w.tc_flops, w.ops)
print(json.dumps(out, indent=1, default=str))
