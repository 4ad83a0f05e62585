"""``nanoserve tune MODEL --int4``: the int4 kernels' tiles for a model's projections.

As ``tune.py`` does for the bf16 GEMV: for each projection and decode row bucket it times the
tensor-core kernel and every GEMV tiling whose output matches it, as CUDA graphs through enough
copies of W that none is read from L2, and writes the fastest into
``configs/int4_gemv/<device>.json`` (``"tensor_core"`` where that kernel wins); then the
tensor-core kernel's own candidates at 16-128 rows (``sweeps.Sweep``) into
``configs/int4_gemm/``. Group size 128 (AWQ's and GPTQ's usual).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import triton

from nanoserve.kernels import int4_gemm, sweeps
from nanoserve.kernels.int4_gemm import TENSOR_CORE, int4_linear
from nanoserve.kernels.int4_gemv import Int4GemvConfig, int4_gemv
from nanoserve.kernels.skinny_gemm import ROW_BUCKETS, shape_key
from nanoserve.config import ModelConfig
from nanoserve.kernels.common import device_sm_count
from nanoserve.kernels.tune import (STREAMED_BYTES, _graph_us, model_to_tune, projection_shapes,
                                    save_fastest)
from nanoserve.kernels.tuning import device_key, save_entries

GROUP = 128
MAX_COPIES = 64


def candidates(rows: int, n: int, k: int) -> list[Int4GemvConfig]:
    """Tilings worth timing: chunks of 128-4096 input features dividing K, 4-16 rows a program,
    the product ``rows x BLOCK_N x BLOCK_K`` at most 32K (about 128 registers a thread at 4
    warps), 8 warps for the larger ones, and K split in 2 or 4 where the row blocks alone
    number fewer than 264 (two per SM of an H100 / H200)."""
    out = []
    for block_k in (128, 256, 512, 1024, 2048, 4096):
        for block_n in (4, 8, 16):
            product = rows * block_n * block_k
            if k % block_k or product > 32768:
                continue
            splits = [s for s in (1, 2, 4) if s <= k // block_k
                      and (s == 1 or triton.cdiv(n, block_n) < 264)]
            for warps in (4, 8) if product >= 16384 else (4,):
                out += [Int4GemvConfig(block_n, block_k, s, warps) for s in splits]
    return out


def int4_weights(n: int, k: int, copies: int, device: torch.device, seed: int):
    gen = torch.Generator(device=device).manual_seed(seed)
    packed = [torch.randint(0, 256, (n, k // 2), generator=gen, device=device,
                            dtype=torch.uint8) for _ in range(copies)]
    sz = [torch.stack([torch.rand(k // GROUP, n, generator=gen, device=device) * 0.004 + 0.001,
                       torch.randn(k // GROUP, n, generator=gen, device=device) * 0.01],
                      -1).bfloat16() for _ in range(copies)]
    return packed, sz


def tune_int4_projection(rows: int, n: int, k: int, device: torch.device
                         ) -> tuple[Int4GemvConfig | str, dict[Int4GemvConfig | str, float]]:
    """The fastest launch (tiles, or ``TENSOR_CORE``) of one projection, and each one's
    microseconds."""
    copies = max(2, min(MAX_COPIES, STREAMED_BYTES // (n * k // 2)))
    packed, sz = int4_weights(n, k, copies, device, n + k + rows)
    x = torch.randn(rows, k, generator=torch.Generator(device=device).manual_seed(rows),
                    device=device).bfloat16()
    want = int4_linear(x, packed[0], sz[0], GROUP, TENSOR_CORE).float()
    times: dict[Int4GemvConfig | str, float] = {TENSOR_CORE: _graph_us(
        lambda i: int4_linear(x, packed[i], sz[i], GROUP, TENSOR_CORE), copies)}
    for config in candidates(rows, n, k):
        got = int4_gemv(x, packed[0], sz[0], GROUP, config).float()
        if not torch.allclose(got, want, atol=5e-2 * want.abs().max().item(), rtol=5e-2):
            continue  # a tiling that computes something else is never a winner
        times[config] = _graph_us(
            lambda i, c=config: int4_gemv(x, packed[i], sz[i], GROUP, c), copies)
    return min(times, key=times.get), times


def tune_int4_model(model: str | Path, rows: tuple[int, ...] = ROW_BUCKETS, tp: int = 1,
                    log: Callable[[str], None] = print) -> Path:
    """Tune every decode projection of ``model`` held as int4 on the current GPU; returns the
    file written."""
    cfg, device = model_to_tune(model)
    entries: dict[str, dict[str, Any]] = {}
    for name, (n, k, _) in projection_shapes(cfg, tp).items():
        if k % GROUP:
            continue
        for bucket in rows:
            began = time.perf_counter()
            best, times = tune_int4_projection(bucket, n, k, device)
            entries.setdefault(shape_key(n, k), {})[str(bucket)] = \
                best if best == TENSOR_CORE else best._asdict()
            log(f"int4 {name} {n}x{k} rows={bucket}: {best} {min(times.values()):.2f} us "
                f"(tensor cores {times[TENSOR_CORE]:.2f} us, {len(times)} timed, "
                f"{time.perf_counter() - began:.0f} s)")
            torch.cuda.empty_cache()
    path = save_entries("int4_gemv", device_key(device), entries)
    log(f"wrote {path}")
    save_fastest(gemm_sweeps(cfg, tp, device), device, _graph_us, log, atol=5e-2)
    return path


def gemm_sweeps(cfg: ModelConfig, tp: int, device: torch.device,
                dtype: torch.dtype = torch.bfloat16) -> Iterator[sweeps.Sweep]:
    """The tensor-core kernel at each projection and the row buckets below cuBLAS's."""
    sms = device_sm_count(device)
    for n, k in {(n, k) for n, k, _ in projection_shapes(cfg, tp).values() if k % GROUP == 0}:
        copies = max(2, min(MAX_COPIES, STREAMED_BYTES // (n * k // 2)))
        packed, sz = int4_weights(n, k, copies, device, n + k)
        sz = [s.to(dtype) for s in sz]
        for rows in int4_gemm.ROW_BUCKETS:
            if rows >= int4_gemm.DEQUANT_ROWS:
                continue
            x = torch.randn(rows, k, device=device).to(dtype)

            def run(config: tuple, i: int, x=x, packed=packed, sz=sz) -> torch.Tensor:
                return int4_gemm.int4_gemm(x, packed[i], sz[i], GROUP, config)

            yield sweeps.Sweep("int4_gemm", int4_gemm.shape_key(n, k, GROUP), str(rows),
                               int4_gemm.candidates(rows, n, k, GROUP, sms), run, copies)
