"""Every recogniser of ``kernelarc.graph``, run in order (larger patterns first)."""

from __future__ import annotations

import torch.fx
from torch.fx import Node

from kernelarc.graph.dwconv import dwconv_sites
from kernelarc.graph.fusion import fused_sites, layer_norm_ok
from kernelarc.graph.gated import glu_sites
from kernelarc.graph.groupnorm import group_norm_sites
from kernelarc.graph.patterns import (
    Site,
    _attention_sites,
    _gemm_sites,
    _layernorm_sites,
    _leftover_sites,
    _rmsnorm_sites,
    _softmax_sites,
)
from kernelarc.graph.quant import fp8_gemm_sites
from kernelarc.graph.rotary import rope_sites
from kernelarc.graph.scatter import scatter_sites
from kernelarc.graph.sorting import sort_sites
from kernelarc.graph.varlen import varlen_sites


def recognize(gm: torch.fx.GraphModule) -> list[Site]:
    """All replaceable sites of ``gm``, larger patterns first; a node belongs to at most one site."""
    sites: list[Site] = []
    taken: set[Node] = set()

    def add(found: list[Site]) -> None:
        for s in found:
            if s.nodes & taken:
                continue
            sites.append(s)
            taken.update(s.nodes)

    attention = _attention_sites(gm)
    add(varlen_sites(gm, attention))  # per-segment attentions of a packed sequence, as one site
    add(attention)
    add(_rmsnorm_sites(gm))
    # an aten.layer_norm over the last axis is a fused region's op (with the adds and casts around it, one kernel);
    # as a library site it would be itself. Written-out LayerNorms are library sites (one F.layer_norm call)
    add([s for s in _layernorm_sites(gm) if not (s.params["style"] == "layer_norm" and layer_norm_ok(s.output))])
    add(group_norm_sites(gm, taken))
    add(dwconv_sites(gm, taken))
    add(fp8_gemm_sites(gm, taken))  # before the plain GEMMs: the fp32 matmul of dequantised operands
    add(_softmax_sites(gm, taken))
    add(glu_sites(gm, taken))
    add(rope_sites(gm, taken))
    add(scatter_sites(gm, taken))  # before the fused regions: the cast after the scatter is its store
    add(sort_sites(gm, taken))  # before the fused regions: a cumsum of the histogram is its output
    add(_gemm_sites(gm, taken))
    add(fused_sites(gm, taken))  # what is left of elementwise ops and reductions, as generated kernels
    add(_leftover_sites(gm, taken))
    return sites


__all__ = ["recognize"]
