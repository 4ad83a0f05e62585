"""Fused elementwise kernels for the decode hot path: RMSNorm and SiLU*mul, one launch each
instead of a chain (launches bound batch-1 decode), in fp32 rounded where the PyTorch reference
(``layers/norm.py``, ``activation.py``) rounds. CUDA-graph capturable. Launch options:
each op's ``*_select`` (the tuning files ``configs/rms_norm|silu_and_mul/<device>.json``, keyed
by the row width and bucketed by rows, else the ``*_heuristic_config``)."""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import programmatic_launch
from nanoserve.kernels.tuning import bucket, load_table, memoised, tuned

# SiLU*mul works on column tiles rather than whole rows: MLP widths reach tens of thousands.
SILU_BLOCK_N = 1024
# Roughly 8 elements per thread (a 16-byte vector of 16-bit values) up to this many warps.
MAX_WARPS = 8
# Warp counts worth timing for a program of a row's (or a tile's) elements.
WARP_CHOICES = (1, 2, 4, 8, 16)
# One program a row (or row tile): few rows want many warps each for latency, many rows fewer
# for occupancy, so tunings are per row count (prefill reaches thousands of rows, times heads).
ROW_BUCKETS = (1, 4, 16, 64, 256, 1024, 4096, 16384)


def num_warps_for(block: int) -> int:
    """Warps for a program that touches ``block`` elements per tensor (untuned heuristic)."""
    return min(max(block // 256, 1), MAX_WARPS)


class RmsNormConfig(NamedTuple):
    """Launch options of one RMSNorm launch (a program holds a whole row: no tile to choose)."""

    num_warps: int


def rms_norm_heuristic_config(dim: int) -> RmsNormConfig:
    """The launch for a width nobody tuned: :func:`num_warps_for` the row."""
    return RmsNormConfig(num_warps_for(triton.next_power_of_2(dim)))


def rms_norm_from_table(table: dict, rows: int, dim: int) -> RmsNormConfig:
    """:func:`rms_norm_select`'s rule over one tuning table (``{"D": {"row bucket": entry}}``)."""
    return tuned(table, str(dim), bucket(rows, ROW_BUCKETS), rms_norm_heuristic_config(dim))


@memoised
def rms_norm_select(rows: int, dim: int, device: torch.device) -> RmsNormConfig:
    """The launch for ``rows`` rows of ``dim``: the device's tuning file's entry, else the
    heuristic's (always off CUDA, whose table is empty: the interpreter ignores warps)."""
    return rms_norm_from_table(load_table("rms_norm", device), rows, dim)


def rms_norm_candidates(dim: int) -> list[RmsNormConfig]:
    """Launches worth timing for rows of ``dim``, the heuristic's first."""
    return list(dict.fromkeys([rms_norm_heuristic_config(dim),
                               *(RmsNormConfig(w) for w in WARP_CHOICES)]))


class SiluAndMulConfig(NamedTuple):
    """Column tile and warps of one SiLU*mul launch (a program a row and tile of columns)."""

    block_n: int = SILU_BLOCK_N
    num_warps: int = num_warps_for(SILU_BLOCK_N)


def silu_and_mul_heuristic_config(n: int) -> SiluAndMulConfig:
    """The launch for a width nobody tuned: tiles of :data:`SILU_BLOCK_N` columns (the whole
    row if shorter), :func:`num_warps_for` the tile."""
    block_n = min(triton.next_power_of_2(n), SILU_BLOCK_N)
    return SiluAndMulConfig(block_n, num_warps_for(block_n))


def silu_and_mul_from_table(table: dict, rows: int, n: int) -> SiluAndMulConfig:
    """:func:`silu_and_mul_select`'s rule over one tuning table (``{"N": {"row bucket":
    entry}}``, N the output's width)."""
    return tuned(table, str(n), bucket(rows, ROW_BUCKETS), silu_and_mul_heuristic_config(n))


@memoised
def silu_and_mul_select(rows: int, n: int, device: torch.device) -> SiluAndMulConfig:
    """The launch for ``rows`` rows of ``n`` outputs: the device's tuning file's entry, else
    the heuristic's (always off CUDA)."""
    return silu_and_mul_from_table(load_table("silu_and_mul", device), rows, n)


def silu_and_mul_candidates(n: int) -> list[SiluAndMulConfig]:
    """Launches worth timing for rows of ``n`` outputs, the heuristic's first: column tiles
    up to the row (fewer, longer programs as they grow), each with the heuristic's warps and
    twice as many."""
    tiles = dict.fromkeys(min(b, triton.next_power_of_2(n)) for b in (256, 512, 1024, 2048, 4096))
    return list(dict.fromkeys([silu_and_mul_heuristic_config(n), *(
        SiluAndMulConfig(b, w) for b in tiles for w in (num_warps_for(b), 2 * num_warps_for(b)))]))


@triton.jit
def _rms_norm_kernel(
    x_ptr, weight_ptr, out_ptr, eps,
    stride_xa, stride_xb, stride_oa, stride_ob,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WEIGHT: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # the projection after the norm may start fetching its weights (skinny_gemm.py)
        gdc_launch_dependents()
    # Rows are indexed (a, b) so a strided [T, H, D] view (q/k slices of qkv) needs no copy.
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < DIM
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if PDL:  # launched early too: x comes from the kernel before
        gdc_wait()
    x = tl.load(x_ptr + a * stride_xa + b * stride_xb + d, mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    # Masked lanes are 0 and add nothing to the sum of squares.
    y = x * tl.rsqrt(tl.sum(x * x, 0) / DIM + eps)
    # The reference casts to the activation dtype before the weight multiply; the product of two
    # 16-bit floats is exact in fp32, so one final rounding reproduces PyTorch's result.
    y = y.to(dtype).to(tl.float32)
    if HAS_WEIGHT:
        y = y * w
    tl.store(out_ptr + a * stride_oa + b * stride_ob + d, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 3-D ``[A, B, D]`` view (no copy): ``[T, D] -> [T, 1, D]``, ``[T, H, D]`` as is."""
    if t.dim() < 3:
        return t.view(-1, 1, t.shape[-1])
    return t.view(-1, t.shape[-2], t.shape[-1])


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             config: RmsNormConfig | None = None) -> torch.Tensor:
    """RMSNorm of ``x [..., D]`` (any 2-D or 3-D view with a contiguous last dimension), rounded
    as ``rms_norm_torch``, into a new tensor in ``promote_types(x.dtype, weight.dtype)``.
    ``weight`` is read before waiting for the kernel before (PDL): it must not be its output.
    ``config``: the launch (default: :func:`rms_norm_select`'s)."""
    dim = x.shape[-1]
    assert weight is None or (weight.shape == (dim,) and weight.is_contiguous()), \
        "weight must be a contiguous [D]"
    assert x.stride(-1) == 1, "the normalised (last) dimension must be contiguous"
    dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3, o3 = _rows(x), _rows(out)
    config = config or rms_norm_select(x3.shape[0] * x3.shape[1], dim, x.device)
    pdl = programmatic_launch(x.device)
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, weight if weight is not None else x3, o3, eps,
        x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), HAS_WEIGHT=weight is not None,
        PDL=pdl, num_warps=config.num_warps, launch_pdl=pdl,
    )
    return out


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_xt, stride_ot,
    N: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):
    if PDL:  # in the MoE chain between two Triton GEMMs (fused_moe.py)
        gdc_launch_dependents()
        gdc_wait()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < N
    row = x_ptr + token * stride_xt
    gate = tl.load(row + cols, mask=mask, other=0.0)
    up = tl.load(row + N + cols, mask=mask, other=0.0)
    tl.store(out_ptr + token * stride_ot + cols, silu_times(gate, up), mask=mask)


@triton.jit
def silu_times(gate, up):
    """``F.silu(gate) * up`` in fp32, rounded where it rounds: silu's result to ``gate``'s dtype
    before the multiply, then the product."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


def silu_and_mul(x: torch.Tensor, config: SiluAndMulConfig | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[..., 2N]`` (rows may be strided) into a new
    ``[..., N]``, rounded as :func:`silu_times` (rare one-ulp ties apart: Triton's ``exp``).
    ``config``: the launch (default: :func:`silu_and_mul_select`'s)."""
    width = x.shape[-1]
    assert width % 2 == 0 and x.stride(-1) == 1, "x is [..., 2N] with a contiguous last dimension"
    n = width // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2, o2 = x.view(-1, width), out.view(-1, n)
    config = config or silu_and_mul_select(x2.shape[0], n, x.device)
    pdl = programmatic_launch(x.device)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, config.block_n))](
        x2, o2, x2.stride(0), o2.stride(0), N=n, BLOCK_N=config.block_n, PDL=pdl,
        num_warps=config.num_warps, launch_pdl=pdl,
    )
    return out
