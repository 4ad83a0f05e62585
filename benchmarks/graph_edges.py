"""Programmatic edges into a captured CUDA graph's kernels (for ``graph_pdl.py``).

The Triton kernels of a decode layer are launched programmatically dependent
(docs/kernels.md), so stream capture records programmatic edges into them. cuBLAS launches its
own kernels without that launch attribute. A captured graph can be edited before it is
instantiated: ``make_edges_programmatic`` turns the edges into kernels whose names it accepts
into programmatic ones (CUDA driver API, ``cuGraph*Dependencies_v2``), so such a kernel is
launched as soon as every program of the kernel before it has signalled or exited. That is
only correct for kernels that wait for their producer (``griddepcontrol.wait``) before reading
its output; cuBLAS's sm_90 kernels do not (run 148, docs/benchmarks.md), so the engine does
not use this.
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from nanoserve.kernels.cuda_build import check_cuda, cuda_driver

_KERNEL_NODE = 0  # CU_GRAPH_NODE_TYPE_KERNEL
# CU_GRAPH_DEPENDENCY_TYPE_PROGRAMMATIC and CU_GRAPH_KERNEL_NODE_PORT_PROGRAMMATIC
_PROGRAMMATIC = 1


class _EdgeData(ctypes.Structure):
    """``CUgraphEdgeData``: the ports and type of one graph edge."""

    _fields_ = [("from_port", ctypes.c_ubyte), ("to_port", ctypes.c_ubyte),
                ("type", ctypes.c_ubyte), ("reserved", ctypes.c_ubyte * 5)]


class _KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2``: read for the kernel's function handle."""

    _fields_ = [("func", ctypes.c_void_p), ("grid", ctypes.c_uint * 3),
                ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("kernel_params", ctypes.c_void_p), ("extra", ctypes.c_void_p),
                ("kern", ctypes.c_void_p), ("ctx", ctypes.c_void_p)]


def _edges(graph: int) -> list[tuple[int, int, _EdgeData]]:
    cu, count = cuda_driver(), ctypes.c_size_t(0)
    check_cuda(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), None, None, None, ctypes.byref(count)),
               "cuGraphGetEdges_v2")
    n = count.value
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), (_EdgeData * n)()
    check_cuda(cu.cuGraphGetEdges_v2(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(count)),
               "cuGraphGetEdges_v2")
    return [(src[i], dst[i], data[i]) for i in range(count.value)]


def kernel_name(node: int) -> str | None:
    """The name of the kernel a graph node launches; None for other nodes."""
    cu, kind = cuda_driver(), ctypes.c_int(-1)
    check_cuda(cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)),
               "cuGraphNodeGetType")
    if kind.value != _KERNEL_NODE:
        return None
    params = _KernelNodeParams()
    check_cuda(cu.cuGraphKernelNodeGetParams_v2(ctypes.c_void_p(node), ctypes.byref(params)),
               "cuGraphKernelNodeGetParams_v2")
    name = ctypes.c_char_p()
    if not params.func and not params.kern:
        return ""
    if params.func:
        check_cuda(cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(params.func)),
                   "cuFuncGetName")
    else:
        check_cuda(cu.cuKernelGetName(ctypes.byref(name), ctypes.c_void_p(params.kern)),
                   "cuKernelGetName")
    return name.value.decode()


def kernel_names(graph: torch.cuda.CUDAGraph) -> list[str]:
    """Names of the kernels on ``graph``'s edges, with each edge's type: ``name>`` for an
    ordinary edge out of it, ``name~>`` for a programmatic one (``keep_graph=True``)."""
    out = []
    for src, dst, data in _edges(graph.raw_cuda_graph()):
        arrow = "~>" if data.type == _PROGRAMMATIC else ">"
        out.append(f"{kernel_name(src)}{arrow}{kernel_name(dst)}")
    return out


def make_edges_programmatic(graph: torch.cuda.CUDAGraph, accept: Callable[[str], bool]) -> int:
    """Turn every ordinary edge from a kernel node into a kernel node that ``accept``s the name
    of into a programmatic edge; returns how many changed. ``graph`` must have been captured
    with ``keep_graph=True`` and be instantiated afterwards."""
    raw = graph.raw_cuda_graph()
    names: dict[int, str | None] = {}

    def name(node: int) -> str | None:
        if node not in names:
            names[node] = kernel_name(node)
        return names[node]

    changed = [(s, d, e) for s, d, e in _edges(raw)
               if e.type != _PROGRAMMATIC and name(s) is not None
               and (dst_name := name(d)) is not None and accept(dst_name)]
    if not changed:
        return 0
    cu, n = cuda_driver(), len(changed)
    src = (ctypes.c_void_p * n)(*[s for s, _, _ in changed])
    dst = (ctypes.c_void_p * n)(*[d for _, d, _ in changed])
    old = (_EdgeData * n)(*[e for _, _, e in changed])
    new = (_EdgeData * n)()
    for e in new:
        e.from_port, e.type = _PROGRAMMATIC, _PROGRAMMATIC
    check_cuda(cu.cuGraphRemoveDependencies_v2(ctypes.c_void_p(raw), src, dst, old,
                                               ctypes.c_size_t(n)), "cuGraphRemoveDependencies_v2")
    check_cuda(cu.cuGraphAddDependencies_v2(ctypes.c_void_p(raw), src, dst, new,
                                            ctypes.c_size_t(n)), "cuGraphAddDependencies_v2")
    return n


def is_cublas_sm90_gemm(name: str) -> bool:
    """cuBLAS's Hopper GEMM kernels (``nvjet_sm90_...``), the decode projections at batch > 1."""
    return name.startswith("nvjet_sm90")

