"""``nanoserve tune MODEL``: launch configurations for a model's real shapes on this GPU, as data.

For the decode projections' GEMV (each row bucket) it times cuBLAS and every tiling whose output
matches, fusions included, as CUDA graphs through enough copies of W that none is read from L2;
for the other ops (``sweeps.py``, ``attention_sweeps.py``) each of the op's ``candidates``
whose output matches the heuristic's. The fastest go into ``configs/<op>/<device>.json``, which
each op's ``select`` reads.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import triton

from nanoserve.config import ModelConfig
from nanoserve.kernels import attention_sweeps as attention
from nanoserve.kernels import skinny_gemm, sweeps
from nanoserve.kernels.skinny_gemm import CUBLAS, ROW_BUCKETS, SkinnyConfig
from nanoserve.kernels.tuning import device_key, save_entries

# Bytes of W a timing graph walks through: several times any GPU's L2.
STREAMED_BYTES = sweeps.STREAMED_BYTES
MAX_COPIES = sweeps.MAX_COPIES
OPS = ("skinny_gemm", "decode_attention", "mla_decode", "prefill_attention", "fused_moe",
       "rms_norm", "silu_and_mul", "qk_norm_rope", "sampling", "fp8_block_gemm")
# Decode attention's buckets timed by default: a graph's batch sizes up to 256, its context caps.
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_CONTEXTS = (512, 2048, 8192, 32768)


def projection_shapes(cfg: ModelConfig, tp: int = 1) -> dict[str, tuple[int, int, dict]]:
    """The decode projections of one rank: name -> (N, K, fusions of ``linear``)."""
    heads, kv_heads = cfg.num_heads // tp, max(1, cfg.num_kv_heads // tp)
    hidden, norm = cfg.hidden_size, {"norm_eps": cfg.rms_norm_eps}
    if cfg.mla:  # latent attention: q and the latent each apply the folded pre-norm
        from nanoserve.layers.mla import LATENT_NORM_EPS

        mla = cfg.mla
        shapes = {"kv_a_proj_with_mqa": (mla.cache_width, hidden, norm),
                  "o_proj": (hidden, heads * mla.v_head_dim, {"residual": True})}
        q_out = heads * mla.qk_head_dim
        if mla.q_lora_rank:
            shapes["q_a_proj"] = (mla.q_lora_rank, hidden, norm)
            shapes["q_b_proj"] = (q_out, mla.q_lora_rank, {"norm_eps": LATENT_NORM_EPS})
        else:
            shapes["q_proj"] = (q_out, hidden, norm)
    else:
        q, kv = heads * cfg.head_dim, kv_heads * cfg.head_dim
        shapes = {"qkv_proj": (q + 2 * kv, hidden, norm),
                  "o_proj": (hidden, q, {"residual": True})}
    if len(cfg.moe_layers) < cfg.num_layers:  # some layers have a dense MLP
        inter = cfg.intermediate_size // tp
        shapes["gate_up_proj"] = (2 * inter, hidden, {**norm, "activate": True})
        shapes["down_proj"] = (hidden, inter, {"residual": True})
    if cfg.moe_layers:
        shapes["router"] = (cfg.num_experts, hidden, {})
    if cfg.moe_layers and cfg.routing is not None and cfg.routing.num_shared:
        inter = cfg.moe_intermediate_size * cfg.routing.num_shared // tp  # DeepSeek's
        shapes["shared_experts.gate_up_proj"] = (2 * inter, hidden, {"activate": True})
        shapes["shared_experts.down_proj"] = (hidden, inter, {"residual": True})
    return shapes


def candidates(rows: int, k: int) -> list[SkinnyConfig]:
    """Tilings worth timing for ``rows`` rows over ``k`` inputs: K chunks of 512-4096, 8-16K
    weights per chunk for one row (4-8K for more), summed per chunk or (one row) at the end."""
    longest = max(triton.next_power_of_2(k), 512)
    return sorted({SkinnyConfig(elements // rows // block_k, block_k, 4, 4, defer)
                   for block_k in (512, 1024, 2048, 4096) if block_k <= longest
                   for elements in ((8192, 16384) if rows == 1 else (4096, 8192))
                   if elements // rows >= block_k
                   for defer in ((False, True) if rows == 1 else (False,))})


def _graph_us(call: Callable[[int], Any], copies: int, replays: int = 10) -> float:
    """Microseconds per call of ``call(i)`` (i: which copy of W), as a CUDA-graph replay."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(copies):  # compiles and settles allocations outside the capture
            call(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(copies):
            call(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / replays / copies)
    return best


def tune_projection(rows: int, n: int, k: int, fusions: dict, device: torch.device
                    ) -> tuple[SkinnyConfig | str, dict[SkinnyConfig | str, float]]:
    """The fastest launch (tiles, or ``CUBLAS``) of one projection, and each one's microseconds."""
    from nanoserve.layers.linear import unfused_linear

    gen = torch.Generator(device=device).manual_seed(n + k + rows)
    copies = max(2, min(MAX_COPIES, STREAMED_BYTES // (2 * n * k)))
    weights = [torch.randn(n, k, generator=gen, device=device, dtype=torch.bfloat16) * k ** -0.5
               for _ in range(copies)]
    x = torch.randn(rows, k, generator=gen, device=device, dtype=torch.bfloat16)
    # The timed calls add into ``work`` over and over; correctness is judged from ``start``.
    start = torch.randn(rows, n, generator=gen, device=device, dtype=torch.bfloat16) \
        if fusions.get("residual") else None
    work = None if start is None else start.clone()

    def run(config: SkinnyConfig | None, i: int, into: torch.Tensor | None) -> torch.Tensor:
        if config is None:
            return unfused_linear(x, weights[i], None, **{**fusions, "residual": into})
        return skinny_gemm.skinny_linear(x, weights[i], None, config,
                                         **{**fusions, "residual": into})

    def fresh() -> torch.Tensor | None:
        return None if start is None else start.clone()

    want = run(None, 0, fresh()).float()
    times: dict[SkinnyConfig | str, float] = {
        CUBLAS: _graph_us(lambda i: run(None, i, work), copies)}
    for config in candidates(rows, k):
        got = run(config, 0, fresh()).float()
        if not torch.allclose(got, want, atol=5e-2, rtol=5e-2):
            continue  # a tiling that computes something else is never a winner
        times[config] = _graph_us(lambda i: run(config, i, work), copies)
    return min(times, key=times.get), times


def op_sweeps(cfg: ModelConfig, tp: int, device: torch.device, ops: Sequence[str],
              batches: Sequence[int], contexts: Sequence[int], fp8_cache: bool = False,
              fp8_block: tuple[int, int] | None = None
              ) -> Iterator[tuple[str, Iterator[sweeps.Sweep]]]:
    """Each of ``ops`` but the GEMV (in :data:`OPS`' order) with the sweeps of ``cfg``'s
    shapes, built lazily (one bucket's inputs on the device at a time); decode attention over
    an fp8 cache with ``fp8_cache``; the block-fp8 GEMM for weights of ``fp8_block`` scale
    blocks (none without)."""
    builders = {
        "decode_attention": lambda: attention.decode_sweeps(cfg, tp, device, batches, contexts,
                                                            fp8_cache),
        "mla_decode": lambda: attention.mla_sweeps(cfg, tp, device, batches, contexts),
        "prefill_attention": lambda: attention.prefill_sweeps(cfg, tp, device),
        "qk_norm_rope": lambda: attention.qk_norm_rope_sweeps(cfg, tp, device),
        "fused_moe": lambda: sweeps.moe_sweeps(cfg, tp, device),
        "rms_norm": lambda: sweeps.row_sweeps("rms_norm", cfg.hidden_size, device),
        "silu_and_mul": lambda: sweeps.row_sweeps("silu_and_mul", cfg.intermediate_size // tp,
                                                  device),
        "sampling": lambda: sweeps.sampling_sweeps(cfg.vocab_size, device),
        "fp8_block_gemm": lambda: sweeps.fp8_block_sweeps(cfg, tp, device, fp8_block)}
    for op, build in builders.items():
        if op in ops:
            yield op, build()


def model_to_tune(model: str | Path, device: torch.device | None = None
                  ) -> tuple[ModelConfig, torch.device]:
    """``model``'s config and the device to tune on (a GPU: an error without one, unless a
    device is given, as tests do under Triton's interpreter)."""
    from nanoserve.config import resolve_model_path
    from nanoserve.models.loader import load_hf_config

    if device is None and not torch.cuda.is_available():
        raise ValueError("nanoserve tune needs a CUDA device")
    return (ModelConfig.from_hf(load_hf_config(resolve_model_path(str(model)))),
            device or torch.device("cuda"))


def fp8_weight_block(model: str | Path) -> tuple[int, int] | None:
    """The scale blocks of ``model``'s block-fp8 weights, if it has such."""
    from nanoserve.config import resolve_model_path
    from nanoserve.layers.quantization.spec import parse_quantization_config
    from nanoserve.models.loader import load_hf_config

    quant = getattr(load_hf_config(resolve_model_path(str(model))), "quantization_config", None)
    spec = None if quant is None else parse_quantization_config(quant)
    return spec.weight_block if spec is not None and spec.fp8_scales == "block" else None


def tune_projections(cfg: ModelConfig, device: torch.device, rows: tuple[int, ...], tp: int,
                     log: Callable[[str], None]) -> Path:
    """Tune every decode projection of ``cfg``; returns the file written."""
    entries: dict[str, dict[str, Any]] = {}
    for name, (n, k, fusions) in projection_shapes(cfg, tp).items():
        for bucket in rows:
            began = time.perf_counter()
            best, times = tune_projection(bucket, n, k, fusions, device)
            entries.setdefault(skinny_gemm.shape_key(n, k), {})[str(bucket)] = \
                best if best == CUBLAS else best._asdict()
            log(f"{name} {n}x{k} rows={bucket}: {best} {min(times.values()):.2f} us "
                f"(cuBLAS {times[CUBLAS]:.2f} us, {len(times)} timed, "
                f"{time.perf_counter() - began:.0f} s)")
    return save_entries("skinny_gemm", device_key(device), entries)


def tune_model(model: str | Path, rows: tuple[int, ...] = ROW_BUCKETS, tp: int = 1,
               log: Callable[[str], None] = print, ops: Sequence[str] = OPS,
               device: torch.device | None = None, timer: sweeps.Timer = _graph_us,
               batches: Sequence[int] = DECODE_BATCHES,
               contexts: Sequence[int] = DECODE_CONTEXTS,
               kv_cache_dtype: str = "auto") -> list[Path]:
    """Tune ``ops`` for ``model``'s shapes (the GEMV at ``rows``, decode attention at
    ``batches`` x ``contexts`` over a ``kv_cache_dtype`` cache); returns the files written."""
    unknown = set(ops) - set(OPS)
    if unknown:
        raise ValueError(f"unknown ops {sorted(unknown)}; tunable: {', '.join(OPS)}")
    if kv_cache_dtype not in ("auto", "fp8"):
        raise ValueError(f"kv_cache_dtype must be auto or fp8, got {kv_cache_dtype!r}")
    cfg, device = model_to_tune(model, device)
    paths = [tune_projections(cfg, device, rows, tp, log)] if "skinny_gemm" in ops else []
    for _, found in op_sweeps(cfg, tp, device, ops, batches, contexts, kv_cache_dtype == "fp8",
                              fp8_weight_block(model)):
        paths += [p for p in save_fastest(found, device, timer, log) if p not in paths]
    for path in paths:
        log(f"wrote {path}")
    return paths


def save_fastest(found: Iterable[sweeps.Sweep], device: torch.device, timer: sweeps.Timer,
                 log: Callable[[str], None], atol: float = 2e-2) -> list[Path]:
    """Time each sweep's candidates and save its fastest into its op's table at once (a run
    cut off keeps what it found); returns the files written."""
    paths: list[Path] = []
    for sweep in found:
        best, times = sweeps.best_launch(sweep, timer, atol)
        path = save_entries(sweep.op, device_key(device), {sweep.shape: {
            sweep.bucket: best._asdict()}})
        paths += [path] if path not in paths else []
        log(f"{sweep.op} {sweep.shape} {sweep.bucket}: {best} {times[best]:.2f} us (heuristic "
            f"{times.get(sweep.candidates[0], float('nan')):.2f} us, {len(times)} timed)")
    return paths
