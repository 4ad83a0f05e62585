"""y = x W^T (+ b) for one to four rows: the decode-time projections at batch 1 (and 2-4).

At batch 1 a projection is a matrix-vector product: reading W once from HBM is all the work,
and for some shapes cuBLAS's choice of tiles reaches a third of the card's bandwidth there
(Qwen3-0.6B's o_proj: 12.6 us where this kernel takes 4.0; docs/kernels.md has the sweep).
Each program owns ``BLOCK_N`` output features and streams their rows of W along K in ``BLOCK_K``
chunks, multiplying by x on the CUDA cores and summing over K. The tiles are tuned per shape
(``TUNED_ONE_ROW``): the best take K in as few chunks as fit, so each program has asked for all
of its W before it sums anything.

``activate=True`` fuses the MLP's ``silu(gate) * up`` into the gate/up projection, which saves
a launch per layer: each program takes the same features of the gate half and the up half of W
(rows interleaved in its tile) and writes their activation. The down projection then reads I
inputs, not 2I, and no program of it recomputes SiLU over the whole row, which is what it did
when down activated ``[gate | up]`` as it loaded it (Qwen3-8B's forward 3.69 ms against 3.81
that way, run 144).

The residual add and RMSNorm between projections cost no launch either. The projection before
them (o_proj, down_proj) adds its output into the residual in its epilogue
(``skinny_linear(..., residual=r, sum_squares=s)``): each program owns its output features, so
the update is in place, and it adds its share of each updated row's sum of squares into ``s``
(one float64 atomic per program and row; why float64 below). The one after them (qkv, gate/up:
``skinny_rms_linear``) multiplies the residual stream h by W and scales its outputs by
``rsqrt(s / K + eps)`` at the end. The norm's weight is folded into W's columns at load time
(``DecoderForCausalLM.fold_norm_weights``), so the K loop reads nothing but h and W and holds
no register for the norm.

The atomics land in whatever order the programs finish. Float32 sums of them differed in
their last bits from run to run (500 runs of one step: 12-481 different sums, run 255), so a
norm's scale moved by ~1e-7, now and then a logit by one bf16 ulp, and a seeded draw near a
boundary came out otherwise in a second engine (runs 253, 255). Each program's share is a
float32 computed in a fixed order; float64 holds the sum of such shares exactly, whatever
the order, while each is above 2^-29 of the row's total (a share below that is two to
sixteen features of almost nothing), so the sum, rounded to float32 where it is read, does
not depend on the order: one sum in 500 runs, and Qwen3-8B's batch-1 step no slower (run 256).

On Hopper the kernel is launched programmatically dependent on the one before it: it fetches its
first tile of W while that kernel still runs and waits for it only before reading x
(docs/kernels.md, "Programmatic dependent launch").
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from nanoserve.kernels.common import interpreted, programmatic_launch
from nanoserve.kernels.fused_ops import silu_times

# How the batch-1 GEMVs (this one and merged_o_proj's) load W: (cache modifier, eviction
# policy), in Triton's spellings. W is read once per step, so its lines go first from L1 and L2
# and x, the residual and the partials stay: Qwen3-8B's forward 3.852 ms against 3.901 with
# the default policy, 0.6B's 0.597 against 0.606 (run 139, docs/kernels.md).
W_LOAD = ("", "evict_first")

# Largest batch the kernel serves: its x tile is a broadcast [rows, BLOCK_N, BLOCK_K] product in
# registers. Layers use it for one row, and for more where TUNED_FEW_ROWS has tiles for the
# row count and shape (cuBLAS was faster at 3-4 rows with generic tiles, docs/kernels.md).
MAX_ROWS = 4


def serves(rows: int, n: int, k: int) -> bool:
    """Whether a decode projection of ``rows`` rows and weight ``[n, k]`` takes this kernel:
    one row always, more where ``TUNED_FEW_ROWS`` has tiles for them."""
    return rows == 1 or (n, k) in TUNED_FEW_ROWS.get(rows, {})


class SkinnyConfig(NamedTuple):
    """Tile sizes and launch options of one skinny-GEMM launch."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    defer_sum: bool = False  # sum over K once at the end rather than once per K chunk


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, b_ptr, y_ptr, r_ptr, ss_ptr,
    M, N, K, eps,
    stride_xm, stride_wn, stride_ym, stride_rm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
    DEFER_SUM: tl.constexpr, RMS: tl.constexpr, ADD_RESIDUAL: tl.constexpr,
    SUM_SQUARES_OUT: tl.constexpr, W_CACHE: tl.constexpr, W_EVICT: tl.constexpr,
    ACTIVATE: tl.constexpr,
):
    if PDL:  # the next projection (down after gate/up) may start fetching its weights
        gdc_launch_dependents()
    pid = tl.program_id(0)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    m_mask = m < M
    if ACTIVATE:  # W = [gate; up]: rows alternate between a gate feature and its up row
        half = N // 2
        j = tl.arange(0, BLOCK_N)
        feature = pid * (BLOCK_N // 2) + j // 2
        n = feature + (j % 2) * half
        n_mask = feature < half
    else:
        n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = n < N
    x_rows = x_ptr + m[:, None] * stride_xm + k[None, :]
    w_rows = w_ptr + n.to(tl.int64)[:, None] * stride_wn + k[None, :]
    # The first chunk of W depends on nothing: with programmatic launch it is fetched while the
    # kernel that writes x still runs, and x is read only after waiting for that kernel.
    k_mask = k < K
    w = tl.load(w_rows, mask=n_mask[:, None] & k_mask[None, :], other=0.0,
                cache_modifier=W_CACHE, eviction_policy=W_EVICT)
    if PDL:
        gdc_wait()
    out_mask = m_mask[:, None] & n_mask[None, :]
    if ADD_RESIDUAL:  # requested now, so that its latency hides behind the K loop
        r = tl.load(r_ptr + m[:, None] * stride_rm + n[None, :], mask=out_mask, other=0.0)
    if RMS:  # x's rows' sums of squares (float64), from the GEMV that wrote x
        row_sum_sq = tl.load(ss_ptr + m, mask=m_mask, other=0.0).to(tl.float32)
    x = tl.load(x_rows, mask=m_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
    if DEFER_SUM:
        acc3 = x[:, None, :] * w.to(tl.float32)[None, :, :]
    else:
        acc = tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    for k_start in range(BLOCK_K, K, BLOCK_K):
        if EVEN_K:
            x_mask = m_mask[:, None]
            w_mask = n_mask[:, None]
        else:
            k_mask = (k_start + k) < K
            x_mask = m_mask[:, None] & k_mask[None, :]
            w_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + k_start, mask=w_mask, other=0.0, cache_modifier=W_CACHE,
                    eviction_policy=W_EVICT)
        x = tl.load(x_rows + k_start, mask=x_mask, other=0.0).to(tl.float32)
        if DEFER_SUM:
            acc3 += x[:, None, :] * w.to(tl.float32)[None, :, :]
        else:
            acc += tl.sum(x[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if DEFER_SUM:
        acc = tl.sum(acc3, axis=2)
    if RMS:  # norm(h) W^T = rsqrt(mean(h^2) + eps) (h W^T), the norm's weight being in W
        acc = acc * tl.rsqrt(row_sum_sq / K + eps)[:, None]
    if HAS_BIAS:
        acc += tl.load(b_ptr + n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    if ACTIVATE:
        gate, up = tl.split(tl.reshape(acc.to(y_ptr.dtype.element_ty),
                                       [BLOCK_M, BLOCK_N // 2, 2]))
        act = silu_times(gate, up)
        features = pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
        tl.store(y_ptr + m[:, None] * stride_ym + features[None, :], act,
                 mask=m_mask[:, None] & (features < half)[None, :])
    elif ADD_RESIDUAL:  # y_ptr is the residual itself
        y_rows = y_ptr + m[:, None] * stride_ym + n[None, :]
        residual_epilogue(acc, r, y_rows, out_mask, ss_ptr + m, m_mask, SUM_SQUARES_OUT)
    else:
        y_rows = y_ptr + m[:, None] * stride_ym + n[None, :]
        tl.store(y_rows, acc.to(y_ptr.dtype.element_ty), mask=out_mask)


@triton.jit
def residual_epilogue(acc, r, r_ptrs, mask, ss_ptrs, row_mask, SUM_SQUARES_OUT: tl.constexpr):
    """Store the fp32 products ``acc`` ([rows, features]) plus the residual ``r`` read from
    ``r_ptrs``, back in place, rounded as ``F.linear(...) + residual``; with
    ``SUM_SQUARES_OUT``, add this program's share of each row's sum of squares, as stored,
    into ``ss_ptrs`` (float64; one atomic per row, of the share summed in float32)."""
    acc = acc.to(r_ptrs.dtype.element_ty).to(tl.float32) + r.to(tl.float32)
    out = acc.to(r_ptrs.dtype.element_ty)
    tl.store(r_ptrs, out, mask=mask)
    if SUM_SQUARES_OUT:
        stored = tl.where(mask, out.to(tl.float32), 0.0)
        share = tl.sum(stored * stored, axis=1).to(tl.float64)
        tl.atomic_add(ss_ptrs, share, mask=row_mask, sem="relaxed")


# Best tiles for one row on an H200, keyed by (N, K): Qwen3-0.6B's and Qwen3-8B's projections.
# From run 25's sweep (benchmarks/skinny_gemm.py --sweep), then, once W was loaded evict-first
# and gate/up wrote the activation, re-swept inside the model's forward (split_decode_chain.py's
# tile= variants, runs 142-146, docs/benchmarks.md). A gate/up program's rows are half gate,
# half up: 8B's 4 rows are 2 features.
TUNED_ONE_ROW = {
    (4096, 1024): SkinnyConfig(16, 1024, 4, 4),
    (1024, 2048): SkinnyConfig(4, 2048, 4, 4, defer_sum=True),
    (6144, 1024): SkinnyConfig(8, 1024, 4, 4),
    (1024, 3072): SkinnyConfig(2, 2048, 4, 4, defer_sum=True),
    (6144, 4096): SkinnyConfig(4, 2048, 4, 4),
    (4096, 4096): SkinnyConfig(4, 4096, 4, 4),
    (24576, 4096): SkinnyConfig(4, 4096, 4, 4),
    (4096, 12288): SkinnyConfig(4, 4096, 4, 4),
}


# Row counts above one that take this kernel, and for each the projections that do, with their
# tiles. Two rows: Qwen3-0.6B's projections, at half the one-row tiles' rows per program
# (down_proj's stays at 2, summed per chunk). Its batch-2 decode forward took 0.671 ms at 512
# keys this way, 0.693 with the one-row tiles, against 0.882-0.889 with cuBLAS, split-K and the
# norm launches (runs 187-190, split_decode_chain.py; docs/kernels.md). No two-row tiling of
# Qwen3-8B's shapes beat cuBLAS (run 189: 4.32-5.01 ms against 4.24). Four rows (the decode
# graph that batches of 3 and 4 replay): the same tiles, 0.902 / 1.122 ms at 512 / 1536 keys
# against 0.934 / 1.191; four other tilings lost to cuBLAS (run 192).
_FEW_ROW_TILES = {
    (4096, 1024): SkinnyConfig(8, 1024, 4, 4),
    (1024, 2048): SkinnyConfig(2, 2048, 4, 4, defer_sum=True),
    (6144, 1024): SkinnyConfig(4, 1024, 4, 4),
    (1024, 3072): SkinnyConfig(2, 2048, 4, 4),
}
TUNED_FEW_ROWS: dict[int, dict[tuple[int, int], SkinnyConfig]] = {2: _FEW_ROW_TILES,
                                                                  4: _FEW_ROW_TILES}


def default_config(n: int, k: int, rows: int, device: torch.device) -> SkinnyConfig:
    """Tiles for a product with ``n`` output features over ``k`` inputs.

    One row: the sweep's best where it measured the shape; otherwise K chunks as long as
    possible (up to 4096) with 16 KB of W per chunk, the shape of most winners: few loop
    trips, so each program has its whole share of W requested before the first sum. More
    rows: ``TUNED_FEW_ROWS`` where it has the row count and shape.
    """
    if interpreted(device):
        return SkinnyConfig(block_n=16, block_k=32, num_warps=1, num_stages=1)
    if (n, k) in TUNED_FEW_ROWS.get(rows, {}):
        return TUNED_FEW_ROWS[rows][(n, k)]
    if rows == 1:
        block_k = min(triton.next_power_of_2(k), 4096)
        return TUNED_ONE_ROW.get((n, k), SkinnyConfig(max(1, 8192 // block_k), block_k, 4, 4))
    return SkinnyConfig(block_n=4 if n <= 4096 else 8, block_k=1024, num_warps=4, num_stages=4)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  config: SkinnyConfig | None = None,
                  residual: torch.Tensor | None = None,
                  sum_squares: torch.Tensor | None = None,
                  activate: bool = False) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` of at most ``MAX_ROWS`` rows.

    ``x`` is ``[M, K]`` (its last dimension contiguous), ``weight`` ``[N, K]`` contiguous; the
    result is a new ``[M, N]`` tensor in ``x``'s dtype. Accumulates in float32.
    With ``residual`` (``[M, N]`` in x's dtype, contiguous rows) the product is added into it
    IN PLACE, rounded as ``F.linear(...) + residual``, and ``residual`` is returned; with
    ``sum_squares`` too (float64 ``[M]``, zero on entry) each row's sum of squares of the
    updated residual, as stored, is added into it, for the norm that follows
    (:func:`skinny_rms_linear`). With ``activate``, ``weight`` is ``[gate; up]`` (``[2I, K]``)
    and the result is ``silu_and_mul(F.linear(x, weight, bias))`` (``[M, I]``), rounded as
    that rounds: each program takes the same features of both halves. Launch shapes depend on
    shapes alone, so the call is CUDA-graph capturable.
    """
    if sum_squares is not None and residual is None:
        raise ValueError("sum_squares is the updated residual's: it needs residual")
    return _launch(x, weight, bias, config, residual=residual,
                   sum_squares=sum_squares, activate=activate)


def skinny_rms_linear(h: torch.Tensor, sum_squares: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None,
                      config: SkinnyConfig | None = None, activate: bool = False
                      ) -> torch.Tensor:
    """``F.linear(h / sqrt(mean(h^2) + eps), weight, bias)``: RMSNorm without its weight, which
    the caller has folded into ``weight``'s columns, for an ``h`` whose rows' sums of squares
    ``sum_squares`` (float64 ``[M]``) the GEMV that wrote it has taken (``skinny_linear``'s).

    The norm is applied to the product, in float32, not to ``h`` (the reference rounds the
    normalised row to 16 bits before the product; this does not). Otherwise as
    :func:`skinny_linear` (``activate`` too: qkv or the MLP's gate/up after the norm).
    """
    return _launch(h, weight, bias, config, rms_eps=eps, sum_squares=sum_squares,
                   activate=activate)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
            config: SkinnyConfig | None,
            residual: torch.Tensor | None = None, rms_eps: float | None = None,
            sum_squares: torch.Tensor | None = None, activate: bool = False) -> torch.Tensor:
    """Checks, then one kernel launch."""
    m, k = x.shape
    n = weight.shape[0]
    if m > MAX_ROWS:
        raise ValueError(f"skinny_linear serves at most {MAX_ROWS} rows, got {m}")
    if weight.shape[1] != k or weight.stride(1) != 1 or x.stride(1) != 1:
        raise ValueError(f"skinny_linear needs x [M, K] and weight [N, K] with contiguous rows; "
                         f"got {tuple(x.shape)} and {tuple(weight.shape)}")
    if residual is not None and (residual.shape != (m, n) or residual.stride(1) != 1
                                 or residual.dtype != x.dtype):
        raise ValueError(f"residual must be [{m}, {n}] in {x.dtype} with contiguous rows, got "
                         f"{tuple(residual.shape)} in {residual.dtype}")
    if sum_squares is not None and (sum_squares.shape != (m,) or sum_squares.stride(0) != 1
                                    or sum_squares.dtype != torch.float64):
        raise ValueError(f"sum_squares must be a contiguous float64 [{m}], got "
                         f"{tuple(sum_squares.shape)} in {sum_squares.dtype}")
    if activate and (n % 2 or residual is not None):
        raise ValueError(f"activate needs weight = [gate; up] (an even number of rows, got {n}) "
                         f"and no residual")
    width = n // 2 if activate else n
    y = residual if residual is not None else torch.empty((m, width), dtype=x.dtype,
                                                          device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(n, k, m, x.device)
    # With activate a program's rows are half gate, half up: an even count of them.
    block_n = max(2, cfg.block_n + cfg.block_n % 2) if activate else cfg.block_n
    pdl = programmatic_launch(x.device)
    block_k = min(cfg.block_k, triton.next_power_of_2(k))
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else y, y, y,
        sum_squares if sum_squares is not None else y,
        m, n, k, rms_eps or 0.0,
        x.stride(0), weight.stride(0), y.stride(0), y.stride(0),
        BLOCK_M=triton.next_power_of_2(m), BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0, PDL=pdl,
        DEFER_SUM=cfg.defer_sum, RMS=rms_eps is not None, ADD_RESIDUAL=residual is not None,
        SUM_SQUARES_OUT=residual is not None and sum_squares is not None,
        W_CACHE=W_LOAD[0], W_EVICT=W_LOAD[1], ACTIVATE=activate,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl,
    )
    return y
