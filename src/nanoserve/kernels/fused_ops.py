"""Fused elementwise kernels for the decode hot path: RMSNorm (+ residual add), SiLU*mul.

Each op replaces a chain of small PyTorch kernels (casts, pow, mean, rsqrt, muls, cat ...) with one
launch, which is what bounds batch-1 decode latency even inside a CUDA graph. Every kernel
computes in fp32 and rounds at the same points as the PyTorch reference it replaces
(`nanoserve.layers.norm`, `.activation`), so results agree to about one unit in the
last place of the output dtype. Launch shapes depend on tensor shapes alone (no host-device sync,
no value-dependent allocation), so every op is CUDA-graph capturable.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import programmatic_launch

if TYPE_CHECKING:
    from nanoserve.layers.norm import RowScale

# SiLU*mul works on column tiles rather than whole rows: MLP widths reach tens of thousands.
SILU_BLOCK_N = 1024
# Roughly 8 elements per thread (a 16-byte vector of 16-bit values) up to this many warps.
MAX_WARPS = 8


def num_warps_for(block: int) -> int:
    """Warps for a program that touches ``block`` elements per tensor (untuned heuristic)."""
    return min(max(block // 256, 1), MAX_WARPS)


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr,
    eps,
    stride_xa, stride_xb, stride_ra, stride_rb, stride_oa, stride_ob, stride_part,
    DIM: tl.constexpr, BLOCK_D: tl.constexpr, ADD_RESIDUAL: tl.constexpr, PDL: tl.constexpr,
    NUM_PARTS: tl.constexpr = 1,
):
    if PDL:  # the projection after the norm may start fetching its weights (skinny_gemm.py)
        gdc_launch_dependents()
    # Rows are indexed (a, b) so that a [T, H, D] view with arbitrary token and head strides
    # (Qwen3's q/k slices of the fused qkv output) needs no copy; 2-D inputs use b = 0.
    a = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    mask = d < DIM
    w = tl.load(weight_ptr + d, mask=mask, other=0.0).to(tl.float32)
    if PDL:  # launched early too: x and the residual come from the kernel before
        gdc_wait()
    x_ptrs = x_ptr + a * stride_xa + b * stride_xb + d
    x = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
    if NUM_PARTS > 1:  # x is a split-K GEMM's fp32 partial sums: add them up, round as its output
        for part in tl.static_range(1, NUM_PARTS):
            x += tl.load(x_ptrs + part * stride_part, mask=mask, other=0.0)
        x = x.to(residual_ptr.dtype.element_ty).to(tl.float32)
    if ADD_RESIDUAL:
        r_ptrs = residual_ptr + a * stride_ra + b * stride_rb + d
        r = tl.load(r_ptrs, mask=mask, other=0.0).to(tl.float32)
        # Round the sum to the activation dtype, as `x + residual` does, and normalise the
        # rounded value: that is the residual the next layer sees.
        s = (x + r).to(residual_ptr.dtype.element_ty)
        tl.store(r_ptrs, s, mask=mask)
        x = s.to(tl.float32)
    # Masked lanes are 0 and add nothing to the sum of squares.
    mean_sq = tl.sum(x * x, 0) / DIM
    y = x * tl.rsqrt(mean_sq + eps)
    # The reference casts to the activation dtype before the weight multiply; the product of two
    # 16-bit floats is exact in fp32, so one final rounding reproduces PyTorch's result.
    # (The residual's dtype is the activations' even when x holds fp32 partial sums.)
    y = y.to(residual_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(out_ptr + a * stride_oa + b * stride_ob + d, y.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a 3-D ``[A, B, D]`` view (no copy): ``[T, D] -> [T, 1, D]``, ``[T, H, D]`` as is."""
    if t.dim() < 3:
        return t.view(-1, 1, t.shape[-1])
    return t.view(-1, t.shape[-2], t.shape[-1])


def _launch_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float, parts: torch.Tensor | None = None) -> torch.Tensor:
    """Shared host side of :func:`rms_norm`, :func:`add_rms_norm` (``residual`` optional) and
    :func:`add_rms_norm_parts` (``parts``: ``[S, *x.shape]`` float32 partial sums that stand
    for ``x``, which is then ``parts[0]``).

    Under programmatic launch the kernel reads ``weight`` before waiting for the kernel before
    it, so ``weight`` must not be that kernel's output (the layers pass their parameters).
    """
    dim = x.shape[-1]
    assert weight.shape == (dim,) and weight.is_contiguous(), "weight must be a contiguous [D]"
    assert x.stride(-1) == 1, "the normalised (last) dimension must be contiguous"
    act_dtype = x.dtype if parts is None else residual.dtype
    # The reference's `x.to(dtype) * weight` promotes, e.g. fp16 activations x fp32 weight -> fp32.
    out = torch.empty(x.shape, dtype=torch.promote_types(act_dtype, weight.dtype), device=x.device)
    if x.numel() == 0:
        return out
    x3, o3 = _rows(x), _rows(out)
    r3 = _rows(residual) if residual is not None else x3  # typed placeholder, never read
    block_d = triton.next_power_of_2(dim)
    pdl = programmatic_launch(x.device)
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, r3, weight, o3,
        eps,
        x3.stride(0), x3.stride(1), r3.stride(0), r3.stride(1), o3.stride(0), o3.stride(1),
        parts.stride(0) if parts is not None else 0,
        DIM=dim, BLOCK_D=block_d, ADD_RESIDUAL=residual is not None,
        NUM_PARTS=parts.shape[0] if parts is not None else 1,
        PDL=pdl, num_warps=num_warps_for(block_d), launch_pdl=pdl,
    )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., D]`` over its last dimension; returns a new contiguous tensor.

    Computes ``(x / sqrt(mean(x^2) + eps)).to(x.dtype) * weight`` in fp32, the rounding order
    of ``nanoserve.layers.norm.RMSNorm``. ``x`` may be a strided view (e.g. ``[T, H, D]`` heads
    sliced out of a fused qkv output) as long as its last dimension is contiguous and its
    leading dimensions collapse to ``[A, B]`` without a copy (any 2-D or 3-D view does).
    The output dtype is ``promote_types(x.dtype, weight.dtype)``.
    """
    return _launch_rms_norm(x, None, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm: returns ``(rms_norm(x + residual), x + residual)``.

    The sum is rounded to ``x.dtype`` (as ``x + residual`` would) and written IN PLACE into
    ``residual``, which is the tensor returned second; ``x`` is not modified. The normalised
    output is a new contiguous tensor. Same layout rules as :func:`rms_norm`, for both inputs.
    """
    assert residual.shape == x.shape and residual.dtype == x.dtype, \
        "x and residual must share a shape and dtype"
    assert residual.stride(-1) == 1, "the residual's last dimension must be contiguous"
    return _launch_rms_norm(x, residual, weight, eps), residual


def add_rms_norm_parts(parts: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`add_rms_norm` of ``x = parts.sum(0)``, rounded to ``residual.dtype`` first.

    ``parts`` (``[S, *residual.shape]`` float32) are a split-K GEMM's partial products; summing
    them here, in the launch that follows the GEMM anyway, costs no launch of its own, and
    rounding the sum once gives what the unsplit GEMM's 16-bit output would be (up to the
    order of the fp32 additions). The sum plus the residual is written IN PLACE into
    ``residual``.
    """
    assert parts.dim() == residual.dim() + 1 and parts.shape[1:] == residual.shape, \
        "parts must be [S, *residual.shape]"
    assert parts.dtype == torch.float32, "partial sums are float32"
    assert residual.stride(-1) == 1, "the residual's last dimension must be contiguous"
    return _launch_rms_norm(parts[0], residual, weight, eps, parts=parts), residual


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, scale_rows_ptr, eps, stride_xt, stride_ot, stride_st,
    N: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
    ROW_SCALE: tl.constexpr = False, HIDDEN: tl.constexpr = 1, BLOCK_H: tl.constexpr = 1,
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
    if ROW_SCALE:  # gate/up projected the un-normalised row: apply its norm's 1/rms here
        # Each column tile of a row sums the row again: a few KB from L2, against a launch.
        factor = row_factor(scale_rows_ptr, token, stride_st, eps, HIDDEN, BLOCK_H)
        gate = scaled_by(gate, factor)
        up = scaled_by(up, factor)
    tl.store(out_ptr + token * stride_ot + cols, silu_times(gate, up), mask=mask)


@triton.jit
def row_factor(rows_ptr, row, stride_row, eps, HIDDEN: tl.constexpr, BLOCK_H: tl.constexpr):
    """``1 / sqrt(mean(r^2) + eps)`` of row ``row`` of ``rows_ptr`` (a ``layers.norm.RowScale``'s
    rows, ``HIDDEN`` wide), in fp32."""
    h = tl.arange(0, BLOCK_H)
    r = tl.load(rows_ptr + row * stride_row + h, mask=h < HIDDEN, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(r * r, 0) / HIDDEN + eps)


@triton.jit
def scaled_by(x, factor):
    """``x`` times a row's ``factor`` in fp32, rounded back to ``x``'s dtype: what the
    normalised row's projection would have been (``layers.norm.row_scale_torch``)."""
    return (x.to(tl.float32) * factor).to(x.dtype)


def row_scale_args(row_scale: RowScale | None, num_rows: int, placeholder: torch.Tensor
                   ) -> tuple[torch.Tensor, float, dict]:
    """A kernel's arguments for an optional row scale: its rows (``placeholder``, never read,
    without one), its eps, and the constexprs (ROW_SCALE, HIDDEN, BLOCK_H) to pass."""
    if row_scale is None:
        return placeholder, 0.0, {}
    rows = row_scale.rows
    assert rows.dim() == 2 and rows.shape[0] == num_rows and rows.stride(-1) == 1, \
        "the row scale's rows are [T, H], one per row of the scaled input"
    hidden = rows.shape[1]
    return rows, row_scale.eps, dict(ROW_SCALE=True, HIDDEN=hidden,
                                     BLOCK_H=triton.next_power_of_2(hidden))


@triton.jit
def silu_times(gate, up):
    """``F.silu(gate) * up`` in fp32, rounded where it rounds: silu's result to ``gate``'s dtype
    before the multiply, then the product."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(gate.dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(gate.dtype)


def silu_and_mul(x: torch.Tensor, row_scale: RowScale | None = None) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` of shape ``[..., 2N]``; returns ``[..., N]``.

    Computed in fp32 with silu's result rounded to ``x.dtype`` before the multiply, as
    ``F.silu(gate) * up`` does; the only difference from PyTorch is Triton's ``exp``, within an
    ulp in fp32, so 16-bit outputs match except for rare one-ulp ties. ``x``'s last dimension
    must be contiguous; rows may be strided. The output is a new contiguous tensor.

    With ``row_scale`` each row of ``x`` is first multiplied by its norm factor and rounded to
    ``x.dtype`` (``layers.norm.row_scale_torch``): the norm the gate/up GEMM before it left out.
    """
    width = x.shape[-1]
    assert width % 2 == 0 and x.stride(-1) == 1, "x is [..., 2N] with a contiguous last dimension"
    n = width // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2, o2 = x.view(-1, width), out.view(-1, n)
    scale_rows, scale_eps, scale_args = row_scale_args(row_scale, x2.shape[0], o2)
    block_n = min(triton.next_power_of_2(n), SILU_BLOCK_N)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block_n))](
        x2, o2, scale_rows, scale_eps, x2.stride(0), o2.stride(0), scale_rows.stride(0),
        N=n, BLOCK_N=block_n, PDL=programmatic_launch(x.device), **scale_args,
        num_warps=num_warps_for(block_n), launch_pdl=programmatic_launch(x.device),
    )
    return out
