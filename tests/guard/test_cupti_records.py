"""Which CUPTI API records the guard's timer switches off (kernelarc/guard/timer.py): queries only, never a
call that enqueues device work (a kernel, copy, set, graph or prefetch), whose record places that work in a
timed iteration. The names are CUPTI's callback ids (cupti-python's runtime/driver_api_trace_cbid)."""

from __future__ import annotations

import pytest

from kernelarc.guard.timer import _QUERY_API, _WORK_API

LAUNCHING = [
    "cudaLaunchKernel_v7000", "cudaLaunchKernel_ptsz_v7000", "cudaLaunchKernelExC_v11060",
    "cudaLaunchCooperativeKernel_v9000", "cudaLaunchHostFunc_v10000", "cudaGraphLaunch_v10000",
    "cudaMemcpyAsync_v3020", "cudaMemcpy2DFromArrayAsync_v3020", "cudaMemsetAsync_v3020",
    "cudaMemPrefetchAsync_v8000", "cudaEventRecord_v3020", "cudaStreamWaitEvent_v3020",
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchGrid", "cuGraphLaunch", "cuMemcpyHtoDAsync_v2",
    "cuMemsetD8Async", "cuMemsetD32_v2", "cuStreamWriteValue32", "cuStreamBatchMemOp", "cuMemcpyBatchAsync",
    "cuGraphGetNodes",
]  # fmt: skip
QUERIES = [
    "cudaGetDevice_v3020", "cudaGetLastError_v3020", "cudaPeekAtLastError_v3020", "cudaStreamIsCapturing_v10000",
    "cudaStreamGetCaptureInfo_v10010", "cudaPointerGetAttributes_v4000", "cudaEventQuery_v3020",
    "cudaDeviceGetAttribute_v5000", "cudaOccupancyMaxActiveBlocksPerMultiprocessor_v6000",
    "cuCtxGetCurrent", "cuStreamGetCaptureInfo_v2", "cuPointerGetAttribute", "cuDeviceGetAttribute",
    "cuDevicePrimaryCtxGetState", "cuGetProcAddress_v2", "cuFuncGetAttribute", "cuModuleGetFunction",
]  # fmt: skip


def _quiet(name: str) -> bool:
    return bool(_QUERY_API.search(name)) and not _WORK_API.search(name)


@pytest.mark.parametrize("name", LAUNCHING)
def test_calls_that_enqueue_device_work_keep_their_records(name):
    assert not _quiet(name)


@pytest.mark.parametrize("name", QUERIES)
def test_queries_lose_theirs(name):
    assert _quiet(name)


def test_the_kept_calls_copy_keeps_structure_and_values():
    """The checked call of a burst may be any call (the judge's secret): its outputs are copied right after it,
    since later calls poison earlier outputs. The copy keeps namedtuples, dicts and lists as they were."""
    import collections

    import torch

    from kernelarc.guard.timer import _snapshot

    Pair = collections.namedtuple("Pair", "y stats")
    y, s = torch.randn(4, 8), torch.randn(4)
    out = _snapshot(torch, [Pair(y, s), {"z": y.t()}, 3])
    assert type(out[0]) is Pair and torch.equal(out[0].y, y) and out[0].y.data_ptr() != y.data_ptr()
    assert out[1]["z"].stride() == y.t().stride()  # dense layouts are copied as they are
    assert out[2] == 3
    y.zero_()  # what poisoning before the next call does to the original
    assert out[0].y.abs().sum() > 0
