"""Batch-1 decode through a stack of dense decoder layers in one persistent launch: an
experiment, timed by ``decode_layers.py``. It measured level with the engine's chain of
kernels (docs/kernels.md, "Persistent decode layers"), so the engine does not use it.

At batch 1 a small model's layer is a chain of latency-bound steps: Qwen3-0.6B reads 31.5 MB
of weights per layer (7.3 us at the H200's bandwidth) but its chain of 6-7 dependent kernels
takes ~23 us, each GEMV spending most of its ~5 us on DRAM latency, ramp-up and tail. Here
one program per SM loops over the layers and phases; the phases meet at grid-wide barriers
(an atomic counter) instead of kernel boundaries, and each program fetches its tile of the
next phase's weights between arriving at a barrier and waiting on it, so the weight stream
runs under the barrier's latency:

    A  qkv = rms(h) W_qkv'            (the norm weight folded into W_qkv')
    B  attention: per (KV head, split) the q group and the new k are normalised and rotated,
       the new k/v stored, and the split's partial softmax written
    C  h += merge(partials) W_o
    D  gu = rms(h) W_gu'
    E  h += (silu(g) * u) W_down

All programs must be resident at once (the barrier waits for every one of them), so the grid
is at most one program per SM. Under Triton's interpreter, which runs programs one after
another, the host launches each phase of each layer on its own instead (``persistent=False``):
the same arithmetic, with kernel boundaries as the barriers.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from nanoserve.kernels.common import LOG2E, device_sm_count, dot_precision, interpreted
from nanoserve.kernels.qk_norm_rope import norm_rope_rows

NUM_PHASES = 5
ALL_PHASES = (1 << NUM_PHASES) - 1
_NUM_PHASES = tl.constexpr(NUM_PHASES)  # the kernel's view of it
# Barrier polls before a program gives up and flags the launch as failed (``sync[1]``), so a
# bug shows as a failed check rather than a hung device.
SPIN_LIMIT = 1 << 20


@triton.jit
def _arrive(sync_ptr):
    tl.debug_barrier()  # every thread's stores of the phase come before the release
    tl.atomic_add(sync_ptr, 1, sem="release")


@triton.jit
def _wait(sync_ptr, target, SPIN_LIMIT: tl.constexpr):
    seen = tl.atomic_add(sync_ptr, 0, sem="acquire")
    spins = 0
    while (seen < target) & (spins < SPIN_LIMIT):
        seen = tl.atomic_add(sync_ptr, 0, sem="acquire")
        spins += 1
    if seen < target:  # flag the launch, and let every later wait of every program through
        tl.atomic_max(sync_ptr + 1, 1)
        tl.atomic_add(sync_ptr, 1 << 30)
    tl.debug_barrier()


@triton.jit
def _stamp(stamps_ptr, index, pid, num_programs, TIMESTAMPS: tl.constexpr):
    """With ``TIMESTAMPS``, the GPU's nanosecond clock into ``stamps[index, pid]`` (profiling)."""
    if TIMESTAMPS:
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                        is_pure=False, pack=1)
        tl.store(stamps_ptr + index * num_programs + pid, now)


@triton.jit
def _weight_tile(w_ptr, tile, N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    k = tl.arange(0, BLOCK_K)
    return tl.load(w_ptr + n[:, None] * K + k[None, :],
                   mask=(n < N)[:, None] & (k < K)[None, :], other=0.0)


@triton.jit
def _store_rms_tile(out_ptr, w, x, rstd, tile, N, BLOCK_N: tl.constexpr):
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1) * rstd
    tl.store(out_ptr + n, acc.to(out_ptr.dtype.element_ty), mask=n < N)


@triton.jit
def _add_residual_tile(h_ptr, w, x, tile, N, BLOCK_N: tl.constexpr):
    n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    r = tl.load(h_ptr + n, mask=n < N, other=0.0, cache_modifier=".cg")
    dtype = h_ptr.dtype.element_ty
    # Rounded as `F.linear(...) + residual`.
    tl.store(h_ptr + n, (acc.to(dtype).to(tl.float32) + r.to(tl.float32)).to(dtype), mask=n < N)


@triton.jit
def _rms_gemv_phase(w_ptr, w_first, h_ptr, out_ptr, pid, num_programs, eps,
                    N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """out = rms(h) W' over this program's tiles of N; ``w_first`` is its first tile, fetched
    before the barrier."""
    k = tl.arange(0, BLOCK_K)
    x = tl.load(h_ptr + k, mask=k < K, other=0.0, cache_modifier=".cg").to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, 0) / K + eps)
    _store_rms_tile(out_ptr, w_first, x, rstd, pid, N, BLOCK_N)
    for tile in range(pid + num_programs, tl.cdiv(N, BLOCK_N), num_programs):
        w = _weight_tile(w_ptr, tile, N, K, BLOCK_N, BLOCK_K)
        _store_rms_tile(out_ptr, w, x, rstd, tile, N, BLOCK_N)


@triton.jit
def _residual_gemv_phase(w_ptr, w_first, x, h_ptr, pid, num_programs,
                         N, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """h += x W over this program's tiles of N (``x`` fp32 ``[BLOCK_K]``, zero past K)."""
    _add_residual_tile(h_ptr, w_first, x, pid, N, BLOCK_N)
    for tile in range(pid + num_programs, tl.cdiv(N, BLOCK_N), num_programs):
        w = _weight_tile(w_ptr, tile, N, K, BLOCK_N, BLOCK_K)
        _add_residual_tile(h_ptr, w, x, tile, N, BLOCK_N)


@triton.jit
def _attention_phase(
    pid, num_programs, qkv_ptr, k_cache_ptr, v_cache_ptr, block_row_ptr, seq_len, slot,
    cos, sin, q_w, q_wp, k_w, k_wp, part_max_ptr, part_sum_ptr, part_acc_ptr,
    scale_log2, qk_eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_QK_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One (KV head, split) item per program: the split decode kernel's work for one sequence."""
    group = NUM_HEADS // NUM_KV_HEADS
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    partner = tl.where(d < HEAD_DIM // 2, d + HEAD_DIM // 2, d - HEAD_DIM // 2)
    sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), NUM_SPLITS)
    last = seq_len - 1
    for item in range(pid, NUM_KV_HEADS * NUM_SPLITS, num_programs):
        kv_head = item // NUM_SPLITS
        split = item % NUM_SPLITS
        start = split * tiles_per_split * BLOCK_N
        end = tl.minimum(start + tiles_per_split * BLOCK_N, seq_len)
        # The new key is the last position: its owner takes it from registers after the loop.
        owns_new = (start <= last) & (last < end)
        end = tl.minimum(end, last)
        head = kv_head * group + g
        q_mask = (g < group)[:, None]
        q = norm_rope_rows(qkv_ptr + head[:, None] * HEAD_DIM, d, partner, q_mask, cos, sin,
                           sign, q_w, q_wp, qk_eps, HAS_QK_NORM, HEAD_DIM)
        k_at = qkv_ptr + (NUM_HEADS + kv_head) * HEAD_DIM
        k_new = norm_rope_rows(k_at, d, partner, d[None, :] < HEAD_DIM, cos, sin, sign, k_w,
                               k_wp, qk_eps, HAS_QK_NORM, HEAD_DIM)
        v_new = tl.load(k_at + NUM_KV_HEADS * HEAD_DIM + d[None, :])
        k_new = k_new.to(k_cache_ptr.dtype.element_ty)
        v_new = v_new.to(v_cache_ptr.dtype.element_ty)
        kv_at = kv_head * HEAD_DIM + d[None, :]
        if owns_new & (slot >= 0):  # a contiguous cache's row of a slot is the slot
            cache_at = slot * (NUM_KV_HEADS * HEAD_DIM)
            tl.store(k_cache_ptr + cache_at + kv_at, k_new)
            tl.store(v_cache_ptr + cache_at + kv_at, v_new)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
        for tile_start in range(start, end, BLOCK_N):
            pos = tile_start + tl.arange(0, BLOCK_N)
            valid = pos < end
            block = tl.load(block_row_ptr + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            row = (block * BLOCK_SIZE + pos % BLOCK_SIZE) * (NUM_KV_HEADS * HEAD_DIM)
            k = tl.load(k_cache_ptr + row[:, None] + kv_at, mask=valid[:, None], other=0.0)
            v = tl.load(v_cache_ptr + row[:, None] + kv_at, mask=valid[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        # The new key as one more step of the online softmax (zero weight outside its owner).
        s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32), 1) * scale_log2
        s_new = tl.where(owns_new, s_new, float("-inf"))
        m_new = tl.maximum(m_i, s_new)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p_new = tl.exp2(s_new - m_safe)
        l_i = l_i * alpha + p_new
        acc = acc * alpha[:, None] + (p_new.to(v_new.dtype).to(tl.float32)[:, None]
                                      * v_new.to(tl.float32))
        part = head * NUM_SPLITS + split
        tl.store(part_max_ptr + part, m_new, mask=g < group)
        tl.store(part_sum_ptr + part, l_i, mask=g < group)
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=q_mask)


@triton.jit
def _merged_attention(part_max_ptr, part_sum_ptr, part_acc_ptr, num_active, h_ptr,
                      Q_WIDTH: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """The attention output (all heads, ``[BLOCK_K]`` fp32, zero past ``Q_WIDTH``) from the
    first ``num_active`` splits' partials, rounded to h's dtype as attention's output is."""
    k = tl.arange(0, BLOCK_K)
    k_mask = k < Q_WIDTH
    first = (k // HEAD_DIM) * NUM_SPLITS
    m = tl.full([BLOCK_K], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_K], tl.float32)
    acc = tl.zeros([BLOCK_K], tl.float32)
    for split in range(0, num_active):
        s_max = tl.load(part_max_ptr + first + split, mask=k_mask, other=0.0,
                        cache_modifier=".cg")
        s_sum = tl.load(part_sum_ptr + first + split, mask=k_mask, other=0.0,
                        cache_modifier=".cg")
        s_acc = tl.load(part_acc_ptr + (first + split) * HEAD_DIM + k % HEAD_DIM, mask=k_mask,
                        other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, s_max)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(s_max - m_new)
        l = l * alpha + s_sum * beta
        acc = acc * alpha + s_acc * beta
        m = m_new
    out = acc / tl.where(l > 0, l, 1.0)
    return tl.where(k_mask, out.to(h_ptr.dtype.element_ty).to(tl.float32), 0.0)


@triton.jit
def _gated_activation(gu_ptr, INTER: tl.constexpr, BLOCK_K: tl.constexpr):
    """silu(gate) * up of the gate/up projection's output, rounded where the reference rounds."""
    k = tl.arange(0, BLOCK_K)
    mask = k < INTER
    gate = tl.load(gu_ptr + k, mask=mask, other=0.0, cache_modifier=".cg")
    up = tl.load(gu_ptr + INTER + k, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
    dtype = gate.dtype
    gate = gate.to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    return (act * up).to(dtype).to(tl.float32)


@triton.jit
def _decode_layers_kernel(
    h_ptr, qkv_ptr, gu_ptr, part_max_ptr, part_sum_ptr, part_acc_ptr,
    w_qkv_ptr, w_o_ptr, w_gu_ptr, w_down_ptr, q_norm_ptr, k_norm_ptr,
    k_cache_ptr, v_cache_ptr, block_table_ptr, seq_len_ptr, position_ptr, slot_ptr, cos_sin_ptr,
    sync_ptr, stamps_ptr,
    first_layer, num_layers, cache_layer_stride, stride_cs,
    eps, qk_eps, scale_log2,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, ATTN_BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_N_QKV: tl.constexpr, BLOCK_N_O: tl.constexpr, BLOCK_N_GU: tl.constexpr,
    BLOCK_N_DOWN: tl.constexpr, BLOCK_HIDDEN: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_INTER: tl.constexpr,
    HAS_QK_NORM: tl.constexpr, DOT_PRECISION: tl.constexpr, PHASES: tl.constexpr,
    SYNC: tl.constexpr, SPIN_LIMIT: tl.constexpr, TIMESTAMPS: tl.constexpr,
):
    pid = tl.program_id(0)
    num_programs = tl.num_programs(0)
    Q_WIDTH = NUM_HEADS * HEAD_DIM
    QKV_N = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    HALF = HEAD_DIM // 2

    # The step's inputs, the same for every layer.
    seq_len = tl.load(seq_len_ptr)
    slot = tl.load(slot_ptr).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    cs_row = cos_sin_ptr + tl.load(position_ptr).to(tl.int64) * stride_cs
    cos = tl.load(cs_row + d % HALF).to(tl.float32)
    sin = tl.load(cs_row + HALF + d % HALF).to(tl.float32)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    tiles_per_split = tl.cdiv(tl.cdiv(seq_len, ATTN_BLOCK_N), NUM_SPLITS)
    num_active = tl.cdiv(tl.cdiv(seq_len, ATTN_BLOCK_N), tiles_per_split)

    for layer in range(first_layer, first_layer + num_layers):
        at = layer + tl.zeros([], tl.int64)  # 64-bit offsets: caches span many GB
        syncs = (layer - first_layer) * _NUM_PHASES * num_programs
        stamp = (layer - first_layer) * _NUM_PHASES * 2
        if PHASES & 1:  # A: qkv
            w_qkv = w_qkv_ptr + at * (QKV_N * HIDDEN)
            w = _weight_tile(w_qkv, pid, QKV_N, HIDDEN, BLOCK_N_QKV, BLOCK_HIDDEN)
            if SYNC:
                _wait(sync_ptr, syncs, SPIN_LIMIT)
            _stamp(stamps_ptr, stamp, pid, num_programs, TIMESTAMPS)
            _rms_gemv_phase(w_qkv, w, h_ptr, qkv_ptr, pid, num_programs, eps,
                            QKV_N, HIDDEN, BLOCK_N_QKV, BLOCK_HIDDEN)
            _stamp(stamps_ptr, stamp + 1, pid, num_programs, TIMESTAMPS)
            if SYNC:
                _arrive(sync_ptr)
        if PHASES & 2:  # B: attention
            if HAS_QK_NORM:
                q_w = tl.load(q_norm_ptr + at * HEAD_DIM + d).to(tl.float32)
                q_wp = tl.load(q_norm_ptr + at * HEAD_DIM + partner).to(tl.float32)
                k_w = tl.load(k_norm_ptr + at * HEAD_DIM + d).to(tl.float32)
                k_wp = tl.load(k_norm_ptr + at * HEAD_DIM + partner).to(tl.float32)
            else:  # unread
                q_w = cos
                q_wp = cos
                k_w = cos
                k_wp = cos
            if SYNC:
                _wait(sync_ptr, syncs + num_programs, SPIN_LIMIT)
            _stamp(stamps_ptr, stamp + 2, pid, num_programs, TIMESTAMPS)
            _attention_phase(
                pid, num_programs, qkv_ptr, k_cache_ptr + at * cache_layer_stride,
                v_cache_ptr + at * cache_layer_stride, block_table_ptr, seq_len, slot,
                cos, sin, q_w, q_wp, k_w, k_wp, part_max_ptr, part_sum_ptr, part_acc_ptr,
                scale_log2, qk_eps, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_G, BLOCK_SIZE,
                ATTN_BLOCK_N, NUM_SPLITS, HAS_QK_NORM, DOT_PRECISION)
            _stamp(stamps_ptr, stamp + 3, pid, num_programs, TIMESTAMPS)
            if SYNC:
                _arrive(sync_ptr)
        if PHASES & 4:  # C: o_proj + residual
            w_o = w_o_ptr + at * (HIDDEN * Q_WIDTH)
            w = _weight_tile(w_o, pid, HIDDEN, Q_WIDTH, BLOCK_N_O, BLOCK_Q)
            if SYNC:
                _wait(sync_ptr, syncs + 2 * num_programs, SPIN_LIMIT)
            _stamp(stamps_ptr, stamp + 4, pid, num_programs, TIMESTAMPS)
            x = _merged_attention(part_max_ptr, part_sum_ptr, part_acc_ptr, num_active, h_ptr,
                                  Q_WIDTH, HEAD_DIM, NUM_SPLITS, BLOCK_Q)
            _residual_gemv_phase(w_o, w, x, h_ptr, pid, num_programs,
                                 HIDDEN, Q_WIDTH, BLOCK_N_O, BLOCK_Q)
            _stamp(stamps_ptr, stamp + 5, pid, num_programs, TIMESTAMPS)
            if SYNC:
                _arrive(sync_ptr)
        if PHASES & 8:  # D: gate/up
            w_gu = w_gu_ptr + at * (2 * INTER * HIDDEN)
            w = _weight_tile(w_gu, pid, 2 * INTER, HIDDEN, BLOCK_N_GU, BLOCK_HIDDEN)
            if SYNC:
                _wait(sync_ptr, syncs + 3 * num_programs, SPIN_LIMIT)
            _stamp(stamps_ptr, stamp + 6, pid, num_programs, TIMESTAMPS)
            _rms_gemv_phase(w_gu, w, h_ptr, gu_ptr, pid, num_programs, eps,
                            2 * INTER, HIDDEN, BLOCK_N_GU, BLOCK_HIDDEN)
            _stamp(stamps_ptr, stamp + 7, pid, num_programs, TIMESTAMPS)
            if SYNC:
                _arrive(sync_ptr)
        if PHASES & 16:  # E: down_proj + residual
            w_down = w_down_ptr + at * (HIDDEN * INTER)
            w = _weight_tile(w_down, pid, HIDDEN, INTER, BLOCK_N_DOWN, BLOCK_INTER)
            if SYNC:
                _wait(sync_ptr, syncs + 4 * num_programs, SPIN_LIMIT)
            _stamp(stamps_ptr, stamp + 8, pid, num_programs, TIMESTAMPS)
            x = _gated_activation(gu_ptr, INTER, BLOCK_INTER)
            _residual_gemv_phase(w_down, w, x, h_ptr, pid, num_programs,
                                 HIDDEN, INTER, BLOCK_N_DOWN, BLOCK_INTER)
            _stamp(stamps_ptr, stamp + 9, pid, num_programs, TIMESTAMPS)
            if SYNC:
                _arrive(sync_ptr)


class LayerWeights(NamedTuple):
    """A stack of dense decoder layers' weights, each ``[L, N, K]`` contiguous, the input norms'
    weights folded into ``qkv``'s and ``gate_up``'s columns; ``q_norm``/``k_norm`` ``[L, D]``
    (Qwen3's per-head norms) or None."""

    qkv: torch.Tensor
    o: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None


class LayerTiles(NamedTuple):
    """Output features per program tile in each GEMV phase (powers of two), attention's keys
    per tile and splits per KV head, and the grid."""

    qkv: int = 32
    o: int = 8
    gate_up: int = 32
    down: int = 8
    num_warps: int = 8
    attn_block_n: int = 64
    num_splits: int = 16
    programs: int | None = None  # default: one per SM


class DecodeStep(NamedTuple):
    """The one sequence's step inputs: its block table row ``[W]`` (int32), and one-element
    ``seq_len`` (int32, the new token included), ``position`` and ``slot`` (int64) tensors."""

    block_table: torch.Tensor
    seq_len: torch.Tensor
    position: torch.Tensor
    slot: torch.Tensor


def decode_layers(h: torch.Tensor, weights: LayerWeights, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, step: DecodeStep, cos_sin: torch.Tensor,
                  eps: float, qk_eps: float, scale: float, tiles: LayerTiles = LayerTiles(),
                  persistent: bool | None = None,
                  stamps: torch.Tensor | None = None) -> torch.Tensor:
    """Runs ``h`` (``[hidden]``, the residual stream, updated IN PLACE) through every layer.

    ``k_cache``/``v_cache`` are ``[L, blocks, block_size, Hkv, D]``; the new token's k and v
    are stored at ``step.slot``. With ``stamps`` (int64 ``[L * 10, programs]``, persistent
    launches only) each program records the GPU clock (ns) as it starts and ends each phase of
    each layer. Returns the launch's sync buffer: ``[1] != 0`` means a barrier
    timed out (a bug, or a grid larger than the device holds at once).
    """
    num_layers, qkv_n, hidden = weights.qkv.shape
    head_dim = k_cache.shape[-1]
    num_kv_heads = k_cache.shape[-2]
    num_heads = weights.o.shape[2] // head_dim
    inter = weights.down.shape[2]
    device = h.device
    if persistent is None:
        persistent = not interpreted(device)
    programs = tiles.programs or device_sm_count(device)
    f32 = dict(dtype=torch.float32, device=device)
    part_max = torch.empty(num_heads * tiles.num_splits, **f32)
    part_sum = torch.empty_like(part_max)
    part_acc = torch.empty(num_heads * tiles.num_splits * head_dim, **f32)
    qkv = torch.empty(qkv_n, dtype=h.dtype, device=device)
    gu = torch.empty(2 * inter, dtype=h.dtype, device=device)
    sync = torch.zeros(2, dtype=torch.int32, device=device)
    has_qk_norm = weights.q_norm is not None
    args = (h, qkv, gu, part_max, part_sum, part_acc, weights.qkv, weights.o, weights.gate_up,
            weights.down, weights.q_norm if has_qk_norm else h,
            weights.k_norm if has_qk_norm else h, k_cache, v_cache, step.block_table,
            step.seq_len, step.position, step.slot, cos_sin, sync,
            sync if stamps is None else stamps)
    consts = dict(
        HIDDEN=hidden, INTER=inter, NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[2], ATTN_BLOCK_N=tiles.attn_block_n,
        BLOCK_G=max(triton.next_power_of_2(num_heads // num_kv_heads), 16),
        NUM_SPLITS=tiles.num_splits, BLOCK_N_QKV=tiles.qkv, BLOCK_N_O=tiles.o,
        BLOCK_N_GU=tiles.gate_up, BLOCK_N_DOWN=tiles.down,
        BLOCK_HIDDEN=triton.next_power_of_2(hidden),
        BLOCK_Q=triton.next_power_of_2(num_heads * head_dim),
        BLOCK_INTER=triton.next_power_of_2(inter), HAS_QK_NORM=has_qk_norm,
        DOT_PRECISION=dot_precision(h.dtype),
        SPIN_LIMIT=SPIN_LIMIT, TIMESTAMPS=stamps is not None, num_warps=tiles.num_warps)
    scalars = (k_cache[0].numel(), cos_sin.stride(0), eps, qk_eps, scale * LOG2E)
    if persistent:
        _decode_layers_kernel[(programs,)](*args, 0, num_layers, *scalars,
                                           PHASES=ALL_PHASES, SYNC=True, **consts)
        return sync
    for layer in range(num_layers):
        for phase in range(NUM_PHASES):
            _decode_layers_kernel[(programs,)](*args, layer, 1, *scalars,
                                               PHASES=1 << phase, SYNC=False, **consts)
    return sync
