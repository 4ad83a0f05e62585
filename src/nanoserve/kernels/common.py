"""Helpers shared by the Triton kernels: host-side checks, launch rules, common device code."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634  # kernels work in base 2 so the softmax can use exp2
# Under TRITON_INTERPRET the "device" is the CPU: a nominal few SMs for grids sized by the SMs.
INTERPRETER_SMS = 4


def interpreted(device: torch.device) -> bool:
    """True when kernels run on CPU tensors, which only Triton's interpreter can execute."""
    return device.type != "cuda"


@functools.cache
def device_sm_count(device: torch.device) -> int:
    """Multiprocessors of ``device`` (a nominal few under the interpreter), cached per device."""
    if interpreted(device):
        return INTERPRETER_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.cache
def programmatic_launch(device: torch.device) -> bool:
    """Whether kernels use programmatic dependent launch (Hopper and later, unless
    ``NANOSERVE_DISABLE_PDL=1``): each starts early, reads its weights, then waits."""
    if interpreted(device) or os.environ.get("NANOSERVE_DISABLE_PDL") == "1":
        return False
    return torch.cuda.get_device_capability(device) >= (9, 0)


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot`` precision for ``dtype``: fp32 inputs would otherwise go through TF32 on GPU."""
    return "ieee" if dtype == torch.float32 else "tf32"


def fp16_products(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether attention over an fp8 cache computes its products in fp16 rather than q's bf16
    (e4m3 widens to fp16 in one instruction, to bf16 in several); the output stays in q's."""
    return k_cache.dtype == torch.float8_e4m3fn and q.dtype == torch.bfloat16


def check_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Assert the shape, dtype and layout contract the attention kernels rely on."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    assert q.dim() == 3 and k_cache.dim() == 4, "q is [T, H, D], caches [blocks, block_size, Hkv, D]"
    assert k_cache.shape == v_cache.shape and k_cache.shape[3] == head_dim
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert k_cache.dtype == v_cache.dtype in (q.dtype, torch.float8_e4m3fn), \
        "the KV cache must be in q's dtype or fp8 e4m3"
    assert triton.next_power_of_2(k_cache.shape[1]) == k_cache.shape[1], \
        "block_size must be a power of two"
    for t in (q, k_cache, v_cache):
        assert t.stride(-1) == 1, "the head dimension must be contiguous"


@triton.jit
def online_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold base-2 scores ``s`` (-inf where masked) and values ``v`` into the online softmax's
    running max, sum and accumulator. A row with no valid key yet comes out NaN."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def masked_softmax_step(s, v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """:func:`online_softmax_step` for tiles where a row may have no valid key yet (a sliding
    window's rows start at different keys): such rows keep m = -inf and add nothing."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def soft_cap(s, cap):
    """``cap * tanh(s / cap)`` (attention logit soft-capping), tanh through exp2 on |s|."""
    e = tl.exp2(-2.8853900817779268 * tl.abs(s) / cap)  # exp(-2|s|/cap), in (0, 1]
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(s < 0, -t, t)
