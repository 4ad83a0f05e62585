"""cuBLASLt's candidate algorithms for the decode projections, timed against PyTorch's choice.

At 16-256 rows every Qwen3-0.6B projection is a ~5-8 µs cuBLAS launch over 4-13 MB of
weights (docs/benchmarks.md). PyTorch runs the heuristic's first choice. This asks cuBLASLt's
heuristic for up to ``--candidates`` algorithms per shape (through ctypes, on the library
PyTorch already loaded), checks each against ``F.linear`` and times each as CUDA-graph replays
over rotating weight copies (so that nothing is read from L2), beside ``F.linear`` (or, for
the split-K projections, ``torch.bmm(..., out_dtype=float32)``, the engine's call).
One JSON line per (projection, rows): PyTorch's µs, the best candidate's µs and its index.

    python benchmarks/cublaslt_algos.py [--rows 16 32 64 128 256] [--candidates 32]
"""
from __future__ import annotations

import argparse
import ctypes
import re

import torch
import torch.nn.functional as F
from common import emit, environment, graph_us

from nanoserve.layers.split_k import split_k_parts

CUDA_R_32F, CUDA_R_16BF = 0, 14
COMPUTE_32F = 68
DESC_TRANSA, DESC_TRANSB = 3, 4
LAYOUT_BATCH_COUNT, LAYOUT_BATCH_STRIDE = 5, 6
PREF_MAX_WORKSPACE = 1
OP_N, OP_T = 0, 1
WORKSPACE_BYTES = 64 << 20
REPLAYS = 50
COPIES = 24  # weight copies per graph: 24 x 4-13 MB is well past the 50 MB L2


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt that this process's PyTorch loaded (found in /proc/self/maps)."""
    a = torch.ones(8, 8, device="cuda", dtype=torch.bfloat16)
    _ = a @ a
    torch.cuda.synchronize()
    with open("/proc/self/maps") as maps:
        paths = {m.group(0) for line in maps if (m := re.search(r"/\S*libcublasLt\.so\S*", line))}
    if not paths:
        raise RuntimeError("libcublasLt is not loaded in this process")
    return ctypes.CDLL(sorted(paths)[0])


def check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with cuBLAS status {status}")


class LtGemm:
    """``out[b] = x[b] @ w[b].T`` for ``batch`` strided slices, bf16 in, ``out_dtype`` out,
    through cuBLASLt with a chosen heuristic candidate."""

    def __init__(self, lib: ctypes.CDLL, handle: ctypes.c_void_p, rows: int, n: int, k: int,
                 ld: int, batch: int, out_dtype: torch.dtype, candidates: int):
        self.lib, self.handle = lib, handle
        self.desc = ctypes.c_void_p()
        check(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, CUDA_R_32F),
              "MatmulDescCreate")
        for attr, op in ((DESC_TRANSA, OP_T), (DESC_TRANSB, OP_N)):
            value = ctypes.c_int32(op)
            check(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value),
                                                       ctypes.c_size_t(4)),
                  "MatmulDescSetAttribute")
        out_type = CUDA_R_32F if out_dtype == torch.float32 else CUDA_R_16BF
        # Column-major view of row-major tensors: out^T [n, rows] = w [n, k] (as k x n, T) @ x^T.
        self.a = self._layout(CUDA_R_16BF, k, n, ld, batch, k)
        self.b = self._layout(CUDA_R_16BF, k, rows, ld, batch, k)
        self.d = self._layout(out_type, n, rows, n, batch, n * rows)
        pref = ctypes.c_void_p()
        check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "PreferenceCreate")
        ws = ctypes.c_uint64(WORKSPACE_BYTES)
        check(lib.cublasLtMatmulPreferenceSetAttribute(
            pref, PREF_MAX_WORKSPACE, ctypes.byref(ws), ctypes.c_size_t(8)), "PreferenceSet")
        results = (HeuristicResult * candidates)()
        found = ctypes.c_int(0)
        check(lib.cublasLtMatmulAlgoGetHeuristic(handle, self.desc, self.a, self.b, self.d, self.d,
                                                 pref, candidates, results, ctypes.byref(found)),
              "AlgoGetHeuristic")
        self.algos = [results[i] for i in range(found.value) if results[i].state == 0]
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def _layout(self, dtype: int, rows: int, cols: int, ld: int, batch: int, stride: int
                ) -> ctypes.c_void_p:
        layout = ctypes.c_void_p()
        check(self.lib.cublasLtMatrixLayoutCreate(
            ctypes.byref(layout), dtype, ctypes.c_uint64(rows), ctypes.c_uint64(cols),
            ctypes.c_int64(ld)), "MatrixLayoutCreate")
        if batch > 1:
            count, offset = ctypes.c_int32(batch), ctypes.c_int64(stride)
            check(self.lib.cublasLtMatrixLayoutSetAttribute(
                layout, LAYOUT_BATCH_COUNT, ctypes.byref(count), ctypes.c_size_t(4)), "batch count")
            check(self.lib.cublasLtMatrixLayoutSetAttribute(
                layout, LAYOUT_BATCH_STRIDE, ctypes.byref(offset), ctypes.c_size_t(8)),
                "batch stride")
        return layout

    def __call__(self, index: int, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor,
                 workspace: torch.Tensor) -> None:
        r = self.algos[index]
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        check(self.lib.cublasLtMatmul(
            self.handle, self.desc, ctypes.byref(self.alpha),
            ctypes.c_void_p(w.data_ptr()), self.a, ctypes.c_void_p(x.data_ptr()), self.b,
            ctypes.byref(self.beta), ctypes.c_void_p(out.data_ptr()), self.d,
            ctypes.c_void_p(out.data_ptr()), self.d, ctypes.byref(r.algo),
            ctypes.c_void_p(workspace.data_ptr()), ctypes.c_size_t(WORKSPACE_BYTES), stream),
            "Matmul")


def projections(rows: int) -> list[tuple[str, int, int, int]]:
    """(name, N, K, split-K slices) of Qwen3-0.6B's decode projections at ``rows``."""
    return [("qkv", 4096, 1024, 1), ("gate_up", 6144, 1024, 1), ("lm_head", 151936, 1024, 1),
            ("o_proj", 1024, 2048, split_k_parts(rows, 1024, 2048)),
            ("down_proj", 1024, 3072, split_k_parts(rows, 1024, 3072))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    parser.add_argument("--candidates", type=int, default=32)
    args = parser.parse_args()
    lib = load_cublaslt()
    handle = ctypes.c_void_p()
    check(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device="cuda")
    env = environment()
    for rows in args.rows:
        for name, n, k, parts in projections(rows):
            copies = 4 if name == "lm_head" else COPIES
            ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
                  for _ in range(copies)]
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            if parts > 1:  # the engine's split-K call: [S, rows, N] float32 partial sums
                kp = k // parts
                out_dtype, out_shape = torch.float32, (parts, rows, n)
                xs = x.view(rows, parts, kp).transpose(0, 1)

                def torch_call(i: int) -> torch.Tensor:
                    return torch.bmm(xs, ws[i].view(n, parts, kp).permute(1, 2, 0),
                                     out_dtype=torch.float32)
            else:
                kp, out_dtype, out_shape = k, torch.bfloat16, (rows, n)

                def torch_call(i: int) -> torch.Tensor:
                    return F.linear(x, ws[i])
            ref = torch_call(0).float()
            gemm = LtGemm(lib, handle, rows, n, kp, k, parts, out_dtype, args.candidates)
            out = torch.empty(out_shape, device="cuda", dtype=out_dtype)
            base = graph_us([lambda i=i: torch_call(i) for i in range(copies)], REPLAYS)
            times, errors = [], []
            for idx in range(len(gemm.algos)):
                out.zero_()
                gemm(idx, x, ws[0], out, workspace)
                torch.cuda.synchronize()
                err = (out.float() - ref).abs().max().item() / ref.abs().max().item()
                errors.append(err)
                calls = [lambda i=i, idx=idx: gemm(idx, x, ws[i], out, workspace)
                         for i in range(copies)]
                times.append(graph_us(calls, REPLAYS) if err < 2e-2 else float("inf"))
            best = min(range(len(times)), key=times.__getitem__) if times else -1
            emit({"bench": "cublaslt_algos", "projection": name, "rows": rows, "n": n, "k": k,
                  "split_k": parts, "torch_us": round(base, 3),
                  "first_candidate_us": round(times[0], 3) if times else None,
                  "best_us": round(times[best], 3) if times else None, "best_index": best,
                  "num_candidates": len(gemm.algos),
                  "candidate_us": [round(t, 2) for t in times],
                  "max_rel_error": max(errors) if errors else None, **env})
            del ws


if __name__ == "__main__":
    main()
