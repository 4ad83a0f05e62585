"""Fused elementwise kernels for the decode hot path: RMSNorm and SiLU*mul, one launch each
instead of a chain (launches bound batch-1 decode), in fp32 rounded where the PyTorch reference
(``layers/norm.py``, ``activation.py``) rounds. CUDA-graph capturable."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import programmatic_launch

# SiLU*mul works on column tiles rather than whole rows: MLP widths reach tens of thousands.
SILU_BLOCK_N = 1024
# Roughly 8 elements per thread (a 16-byte vector of 16-bit values) up to this many warps.
MAX_WARPS = 8


def num_warps_for(block: int) -> int:
    """Warps for a program that touches ``block`` elements per tensor (untuned heuristic)."""
    return min(max(block // 256, 1), MAX_WARPS)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [..., D]`` (any 2-D or 3-D view with a contiguous last dimension), rounded
    as ``rms_norm_torch``, into a new tensor in ``promote_types(x.dtype, weight.dtype)``.
    ``weight`` is read before waiting for the kernel before (PDL): it must not be its output."""
    dim = x.shape[-1]
    assert weight is None or (weight.shape == (dim,) and weight.is_contiguous()), \
        "weight must be a contiguous [D]"
    assert x.stride(-1) == 1, "the normalised (last) dimension must be contiguous"
    dtype = x.dtype if weight is None else torch.promote_types(x.dtype, weight.dtype)
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() == 0:
        return out
    x3, o3 = _rows(x), _rows(out)
    block_d = triton.next_power_of_2(dim)
    pdl = programmatic_launch(x.device)
    _rms_norm_kernel[(x3.shape[0], x3.shape[1])](
        x3, weight if weight is not None else x3, o3, eps,
        x3.stride(0), x3.stride(1), o3.stride(0), o3.stride(1),
        DIM=dim, BLOCK_D=block_d, HAS_WEIGHT=weight is not None,
        PDL=pdl, num_warps=num_warps_for(block_d), launch_pdl=pdl,
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


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``x = [gate | up]`` ``[..., 2N]`` (rows may be strided) into a new
    ``[..., N]``, rounded as :func:`silu_times` (rare one-ulp ties apart: Triton's ``exp``)."""
    width = x.shape[-1]
    assert width % 2 == 0 and x.stride(-1) == 1, "x is [..., 2N] with a contiguous last dimension"
    n = width // 2
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    if out.numel() == 0:
        return out
    x2, o2 = x.view(-1, width), out.view(-1, n)
    block_n = min(triton.next_power_of_2(n), SILU_BLOCK_N)
    pdl = programmatic_launch(x.device)
    _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block_n))](
        x2, o2, x2.stride(0), o2.stride(0), N=n, BLOCK_N=block_n, PDL=pdl,
        num_warps=num_warps_for(block_n), launch_pdl=pdl,
    )
    return out
