"""FlashAttention forward families for the ``attention`` and ``attention_residual`` tasks.

The kernel, its knobs, its resource model and its renderer live in ``_attn_common``; this
module only names the families (one per task) so that discovery finds them.
"""

from __future__ import annotations

from kernelarc.families._attn_common import make_family

FLASH = make_family(
    "attention.flash",
    "attention",
    residual=False,
    description="FlashAttention-2 forward: online exp2 softmax, causal block skipping, GQA, pointer or TMA loads",
)

FLASH_RESIDUAL = make_family(
    "attention_residual.flash",
    "attention_residual",
    residual=True,
    description="FlashAttention-2 forward with the residual add fused into the epilogue",
)

FAMILIES = [FLASH, FLASH_RESIDUAL]
