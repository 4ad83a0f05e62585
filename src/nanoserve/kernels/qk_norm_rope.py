"""One Triton launch for everything between the qkv projection and attention, instead of four
or five: Qwen3's optional per-head q/k RMSNorm, RoPE on q (in place) and k, and the KV-cache
store, rounded as the PyTorch reference (``rms_norm_torch``, ``rotary_embedding_torch``).
Launch options: :func:`select` (the tuning file ``configs/qk_norm_rope/<device>.json``, keyed by
the head counts and size and bucketed by tokens, else :func:`heuristic_config`).
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import programmatic_launch
from nanoserve.kernels.fused_ops import ROW_BUCKETS, WARP_CHOICES, num_warps_for
from nanoserve.kernels.tuning import bucket, load_table, memoised, tuned


class QkNormRopeConfig(NamedTuple):
    """Launch options of one q/k-norm + RoPE + store launch (a program holds all of a token's
    q heads or K/V heads: no tile to choose)."""

    num_warps: int


def shape_key(num_q_heads: int, num_kv_heads: int, head_dim: int) -> str:
    return f"{num_q_heads}x{num_kv_heads}x{head_dim}"


def heuristic_config(num_q_heads: int, num_kv_heads: int, head_dim: int) -> QkNormRopeConfig:
    """The launch for a shape nobody tuned: fused_ops' rule (~8 elements a thread) on the
    largest tile, one half of the q heads."""
    return QkNormRopeConfig(num_warps_for(triton.next_power_of_2(num_q_heads)
                                          * triton.next_power_of_2(head_dim // 2)))


def from_table(table: dict, num_tokens: int, num_q_heads: int, num_kv_heads: int,
               head_dim: int) -> QkNormRopeConfig:
    """:func:`select`'s rule over one tuning table (``{"HqxHkvxD": {"token bucket": entry}}``,
    tokens bucketed as fused_ops' rows: two programs a token)."""
    return tuned(table, shape_key(num_q_heads, num_kv_heads, head_dim),
                 bucket(num_tokens, ROW_BUCKETS),
                 heuristic_config(num_q_heads, num_kv_heads, head_dim))


@memoised
def select(num_tokens: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
           device: torch.device) -> QkNormRopeConfig:
    """The launch for ``num_tokens`` tokens: the device's tuning file's entry, else the
    heuristic's (always off CUDA, whose table is empty: the interpreter ignores warps)."""
    return from_table(load_table("qk_norm_rope", device), num_tokens, num_q_heads, num_kv_heads,
                      head_dim)


def candidates(num_q_heads: int, num_kv_heads: int, head_dim: int) -> list[QkNormRopeConfig]:
    """Launches worth timing for the shape, the heuristic's first."""
    return list(dict.fromkeys([heuristic_config(num_q_heads, num_kv_heads, head_dim),
                               *(QkNormRopeConfig(w) for w in WARP_CHOICES)]))


class NewTokens(NamedTuple):
    """The step's new ``k``/``v`` (``[T, Hkv, D]``, maybe strided) as the qkv projection left
    them, for a kernel to finish: ``slot_mapping`` -1 is not stored, ``cos_sin`` is RoPE's
    ``[max_pos, D]`` table of ``[cos | sin]`` rows, ``q_weight``/``k_weight`` the head norms'."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    cos_sin: torch.Tensor
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None
    eps: float = 0.0

    def check(self, num_tokens: int, num_kv_heads: int, head_dim: int) -> None:
        assert self.k.shape == self.v.shape == (num_tokens, num_kv_heads, head_dim)
        assert self.positions.shape == self.slot_mapping.shape == (num_tokens,)
        assert head_dim % 2 == 0 and self.cos_sin.shape[-1] == head_dim
        assert (self.q_weight is None) == (self.k_weight is None), \
            "q and k are normalised together or not at all"
        for t in (self.k, self.v, self.cos_sin):
            assert t.stride(-1) == 1, "the head dimension must be contiguous"

    def kernel_args(self) -> tuple:
        """The split kernel's new-token pointers, then its new-token strides."""
        weights = (self.cos_sin, self.cos_sin) if self.q_weight is None else (self.q_weight,
                                                                               self.k_weight)
        return ((self.k, self.v, self.positions, self.slot_mapping, self.cos_sin, *weights),
                (self.k.stride(0), self.k.stride(1), self.v.stride(0), self.v.stride(1),
                 self.cos_sin.stride(0)))


@triton.jit
def _load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cs,
                 HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """``token``'s RoPE cos and sin rows as fp32 ``[1, BLOCK_HALF]`` tiles (0 past ``HALF``)."""
    pos = tl.load(positions_ptr + token).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    row = cos_sin_ptr + pos * stride_cs + j
    cos = tl.load(row, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(row + HALF, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
    return cos, sin


@triton.jit
def _norm_rope_heads(
    first, mask, cos, sin, weight_ptr, eps,
    HAS_QK_NORM: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    # One token's heads at `first` (each head's first half) normalised and rotated in fp32.
    dtype = first.dtype.element_ty
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        # Masked lanes are 0 and add nothing to the sum of squares.
        mean_sq = (tl.sum(x1 * x1, 1) + tl.sum(x2 * x2, 1)) / (2 * HALF)
        rstd = tl.rsqrt(mean_sq + eps)[:, None]
        j = tl.arange(0, BLOCK_HALF)
        w1 = tl.load(weight_ptr + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(weight_ptr + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)[None, :]
        # rms_norm_torch rounds the normalised value before the weight multiply and the product
        # after it (exact in fp32 for 16-bit inputs); RoPE then starts from that rounded value.
        x1 = ((x1 * rstd).to(dtype).to(tl.float32) * w1).to(dtype).to(tl.float32)
        x2 = ((x2 * rstd).to(dtype).to(tl.float32) * w2).to(dtype).to(tl.float32)
    return (x1 * cos - x2 * sin).to(dtype), (x2 * cos + x1 * sin).to(dtype)


@triton.jit
def norm_rope_rows(rows, d, partner, mask, cos, sin, sign, w, w_partner, eps,
                    HAS_QK_NORM: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Heads at ``rows`` normalised (optional) and rotated as ``_norm_rope_heads`` rounds them,
    as whole ``[heads, D]`` tiles (decode attention's q group): d pairs with ``partner`` =
    d +- D/2, ``sign`` is -1 on the first half, ``w``/``w_partner`` the norm weight at each."""
    x = tl.load(rows + d[None, :], mask=mask, other=0.0)
    dtype = x.dtype
    x = x.to(tl.float32)
    x_partner = tl.load(rows + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_QK_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, 1) / HEAD_DIM + eps)[:, None]
        x = ((x * rstd).to(dtype).to(tl.float32) * w[None, :]).to(dtype).to(tl.float32)
        x_partner = ((x_partner * rstd).to(dtype).to(tl.float32)
                     * w_partner[None, :]).to(dtype).to(tl.float32)
    return (x * cos[None, :] + sign[None, :] * x_partner * sin[None, :]).to(dtype)


@triton.jit
def _qk_norm_rope_store_kernel(
    positions_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, cos_sin_ptr, q_weight_ptr, k_weight_ptr,
    k_cache_ptr, v_cache_ptr,
    eps,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HAS_QK_NORM: tl.constexpr, PDL: tl.constexpr,
):
    # Two programs per token, one for its q heads and one for its K/V heads, side by side.
    token = tl.program_id(0).to(tl.int64)
    # Positions, slots and the cos/sin table are step inputs: read before waiting (PDL).
    cos, sin = _load_cos_sin(positions_ptr, cos_sin_ptr, token, stride_cs, HALF, BLOCK_HALF)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if PDL:
        gdc_launch_dependents()
        gdc_wait()
    j = tl.arange(0, BLOCK_HALF)
    if tl.program_id(1) == 0:
        hq = tl.arange(0, BLOCK_HQ)
        q_mask = (hq < NUM_Q_HEADS)[:, None] & (j < HALF)[None, :]
        q_first = q_ptr + token * stride_qt + hq[:, None] * stride_qh + j[None, :]
        q1, q2 = _norm_rope_heads(q_first, q_mask, cos, sin, q_weight_ptr, eps,
                                  HAS_QK_NORM, HALF, BLOCK_HALF)
        tl.store(q_first, q1, mask=q_mask)
        tl.store(q_first + HALF, q2, mask=q_mask)
    elif slot >= 0:
        # Padding tokens (CUDA-graph batches) carry slot -1: their k is neither rotated nor stored.
        hk = tl.arange(0, BLOCK_HK)
        kv_mask = (hk < NUM_KV_HEADS)[:, None] & (j < HALF)[None, :]
        k_first = k_ptr + token * stride_kt + hk[:, None] * stride_kh + j[None, :]
        k1, k2 = _norm_rope_heads(k_first, kv_mask, cos, sin, k_weight_ptr, eps,
                                  HAS_QK_NORM, HALF, BLOCK_HALF)
        block = slot // BLOCK_SIZE
        offset = slot % BLOCK_SIZE
        kc_first = (k_cache_ptr + block * stride_kcb + offset * stride_kcs
                    + hk[:, None] * stride_kch + j[None, :])
        cache_dtype = k_cache_ptr.dtype.element_ty
        tl.store(kc_first, k1.to(cache_dtype), mask=kv_mask)
        tl.store(kc_first + HALF, k2.to(cache_dtype), mask=kv_mask)

        v_first = v_ptr + token * stride_vt + hk[:, None] * stride_vh + j[None, :]
        vc_first = (v_cache_ptr + block * stride_vcb + offset * stride_vcs
                    + hk[:, None] * stride_vch + j[None, :])
        v_dtype = v_cache_ptr.dtype.element_ty
        v1 = tl.load(v_first, mask=kv_mask)
        v2 = tl.load(v_first + HALF, mask=kv_mask)
        tl.store(vc_first, v1.to(v_dtype), mask=kv_mask)
        tl.store(vc_first + HALF, v2.to(v_dtype), mask=kv_mask)


def qk_norm_rope_store(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                       q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                       eps: float = 0.0, config: QkNormRopeConfig | None = None
                       ) -> torch.Tensor:
    """Optional per-head q/k RMSNorm, RoPE, then the KV-cache store, in one launch; returns q.

    ``q [T, Hq, D]`` is normalised and rotated IN PLACE; the rotated k and v (untouched) go to
    the caches ``[num_blocks, block_size, Hkv, D]`` at ``slot_mapping`` (see :class:`NewTokens`).
    Positions are not bounds-checked. CUDA-graph capturable. ``config``: the launch (default:
    :func:`select`'s)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    NewTokens(k, v, positions, slot_mapping, cos_sin, q_weight, k_weight).check(
        num_tokens, num_kv_heads, head_dim)
    assert k_cache.shape == v_cache.shape and k_cache.shape[2:] == (num_kv_heads, head_dim)
    for t in (q, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"
    has_qk_norm = q_weight is not None
    if has_qk_norm:
        # The reference would promote a wider weight's product; in place into q it cannot.
        for w in (q_weight, k_weight):
            assert w.shape == (head_dim,) and w.is_contiguous() and w.dtype == q.dtype == k.dtype
    if num_tokens == 0:
        return q
    config = config or select(num_tokens, num_q_heads, num_kv_heads, head_dim, q.device)
    half = head_dim // 2
    pdl = programmatic_launch(q.device)
    _qk_norm_rope_store_kernel[(num_tokens, 2)](
        positions, slot_mapping, q, k, v, cos_sin,
        q_weight if has_qk_norm else cos_sin, k_weight if has_qk_norm else cos_sin,  # unread
        k_cache, v_cache,
        eps,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos_sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads), BLOCK_HALF=triton.next_power_of_2(half),
        BLOCK_SIZE=k_cache.shape[1], HAS_QK_NORM=has_qk_norm, PDL=pdl,
        num_warps=config.num_warps, launch_pdl=pdl,
    )
    return q
