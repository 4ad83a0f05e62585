"""Floors: the least time a step, a batch-1 decode or a workload takes for its bytes and FLOPs.

One place for every benchmark's floor. For a shape (a Hugging Face config dict, bf16 weights)
and one engine step (each sequence's chunk of new tokens and the keys they attend):

- bytes: the weights read once per step (every layer's projections, their q/k/v biases, the
  norms' weights, one embedding row per token, the LM head where the step samples), the KV
  cache read (each sequence's keys and values, all layers: layers * 2 * kv_heads * head_dim *
  keys * bytes per value, once per sequence and step) and the new tokens' K/V written;
- FLOPs: 2 * matrix parameters a token touches * tokens (the LM head only for tokens that
  sample), plus attention's 4 * heads * head_dim * keys per token and layer (QK^T and PV);
  norms, biases, RoPE, activations and sampling are left out (well under 1%); a sliding
  layer reads and attends only its window's keys (each layer's window as the engine reads the
  config);
- floor = max(bytes / copy bandwidth, FLOPs / matmul peak); the bytes-only floor is
  bytes / bandwidth. A sequence of steps sums each step's floor (steps run one after another).

Mixture of experts: a step reads the router and, in each layer, the experts its tokens pick.
With T tokens each picking k of E experts, routing is taken as uniform and independent (random
weights route close to that): E * (1 - (1 - k/E)^T) distinct experts per layer, k at T = 1.
Each token of a step is taken to read its own embedding row.

Ceilings: ``measure_ceilings()`` times a large device-to-device copy (bytes read + written) and
a large bf16 ``torch.matmul`` once per process; without a GPU the H200 defaults stand in.

    python benchmarks/floor.py            # the arithmetic's self-check against hand numbers
    python benchmarks/floor.py --engine   # and the simulated schedule against the engine's (CPU)
    python benchmarks/floor.py qwen3-8b   # a shape's floors: batch-1 decode, the workload
"""
from __future__ import annotations

import dataclasses
import functools
import json
import random
import sys
import time
from collections.abc import Iterable, Sequence

# An H200's ceilings as measured here: copy bandwidth (bytes read + written by a 4 GiB
# device-to-device copy) and an 8192^3 bf16 torch.matmul on random data.
H200_BANDWIDTH = 4.27e12  # B/s
H200_PEAK = 790e12  # FLOP/s

# nano-vLLM's throughput workload and the engine's offline defaults for it.
WORKLOAD_NUM_SEQS = 256
OFFLINE_MAX_NUM_BATCHED_TOKENS = 16384


# ---- a shape's sizes ------------------------------------------------------------------------

def head_dim(shape: dict) -> int:
    return shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]


def has_qkv_bias(shape: dict) -> bool:
    """Qwen2's architecture implies q/k/v biases; other configs say so in attention_bias."""
    return bool(shape.get("attention_bias")) or shape["architectures"][0] == "Qwen2ForCausalLM"


def has_qk_norm(shape: dict) -> bool:
    return shape["architectures"][0] in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def qwen_moe_keys(shape: dict) -> dict:
    """``shape`` with Mixtral's and GPT-OSS's expert fields (``num_local_experts``, experts
    ``intermediate_size`` wide) under Qwen3-MoE's names, which the floors read."""
    if not shape.get("num_local_experts") or shape.get("num_experts"):
        return shape
    return {**shape, "num_experts": shape["num_local_experts"],
            "moe_intermediate_size": shape["intermediate_size"]}


def moe_layers(shape: dict) -> int:
    """How many layers have a mixture-of-experts MLP (Qwen3-MoE's rule)."""
    shape = qwen_moe_keys(shape)
    if not shape.get("num_experts"):
        return 0
    step = shape.get("decoder_sparse_step") or 1
    dense = set(shape.get("mlp_only_layers") or [])
    return sum(1 for i in range(shape["num_hidden_layers"])
               if i not in dense and (i + 1) % step == 0)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """Parameter counts of a shape (numbers of values, not bytes)."""

    layers: int
    attention: int  # one layer's q/k/v and o matrices
    dense_mlp: int  # one dense layer's gate, up and down matrices
    expert: int  # one expert's gate, up and down matrices
    router: int  # one MoE layer's router
    small: int  # all layers' biases and norm weights, and the final norm
    embedding: int  # the embedding matrix (vocab * hidden)
    lm_head: int  # the LM head matrix (the embedding's when tied)
    num_dense_layers: int
    num_moe_layers: int
    experts: int
    top_k: int
    kv_per_token: int  # K and V values one token stores, all layers
    attention_heads: int
    head_dim: int
    windows: tuple[int, ...]  # each layer's sliding window (0: every key)


def sizes(shape: dict) -> Sizes:
    shape = qwen_moe_keys(shape)
    h, layers = shape["hidden_size"], shape["num_hidden_layers"]
    d = head_dim(shape)
    q, kv = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    attention = h * (q + 2 * kv) + q * h
    small_per_layer = 2 * h + (q + 2 * kv if has_qkv_bias(shape) else 0) + \
        (2 * d if has_qk_norm(shape) else 0)
    num_moe = moe_layers(shape)
    return Sizes(
        layers=layers, attention=attention, dense_mlp=3 * h * shape["intermediate_size"],
        expert=3 * h * shape.get("moe_intermediate_size", 0),
        router=shape.get("num_experts", 0) * h, small=layers * small_per_layer + h,
        embedding=shape["vocab_size"] * h, lm_head=shape["vocab_size"] * h,
        num_dense_layers=layers - num_moe, num_moe_layers=num_moe,
        experts=shape.get("num_experts", 0), top_k=shape.get("num_experts_per_tok", 0),
        kv_per_token=layers * 2 * kv, attention_heads=shape["num_attention_heads"], head_dim=d,
        windows=layer_windows(json.dumps(shape, sort_keys=True)))


@functools.lru_cache(maxsize=64)
def layer_windows(shape_json: str) -> tuple[int, ...]:
    """Each layer's sliding window in a shape (as JSON: a cache key) as the engine reads its
    config: transformers fills in the layer types, ``ModelConfig`` keeps the honoured ones."""
    shape = json.loads(shape_json)
    if not shape.get("sliding_window") or "model_type" not in shape:
        return (0,) * shape["num_hidden_layers"]
    from transformers import AutoConfig

    from nanoserve.config import ModelConfig

    fields = {k: v for k, v in shape.items() if k != "model_type"}
    return tuple(ModelConfig.from_hf(AutoConfig.for_model(shape["model_type"], **fields))
                 .layer_windows)


def keys_read(start: int, num_tokens: int, window: int) -> int:
    """Keys a chunk of ``num_tokens`` from ``start`` reads once: all, or its windows' span."""
    end = start + num_tokens
    return min(end, window + num_tokens - 1) if window else end


def keys_attended(start: int, num_tokens: int, window: int) -> int:
    """Keys the chunk's tokens attend, summed: position p sees min(p + 1, window) keys."""
    first, last = start + 1, start + num_tokens  # p + 1 over the chunk
    if not window or last <= window:
        return (first + last) * num_tokens // 2
    below = max(0, window - first + 1)  # tokens still inside their first window's reach
    return (first + first + below - 1) * below // 2 + window * (num_tokens - below)


def experts_touched(shape: dict, num_tokens: int) -> float:
    """Distinct experts per MoE layer that ``num_tokens`` tokens read, routing uniform and
    independent: E * (1 - (1 - k/E)^T)."""
    s = sizes(shape)
    if not s.experts or num_tokens == 0:
        return 0.0
    return s.experts * (1.0 - (1.0 - s.top_k / s.experts) ** num_tokens)


def parameters(shape: dict) -> int:
    """All parameters of the shape (the embedding and LM head once when tied)."""
    s = sizes(shape)
    tied = shape.get("tie_word_embeddings", False)
    return (s.layers * s.attention + s.num_dense_layers * s.dense_mlp
            + s.num_moe_layers * (s.experts * s.expert + s.router) + s.small + s.embedding
            + (0 if tied else s.lm_head))


# ---- one step -------------------------------------------------------------------------------

@dataclasses.dataclass
class Floor:
    """Bytes and FLOPs of one or more steps, and their floors in seconds under the ceilings.

    ``seconds`` sums each step's max(bytes / bandwidth, FLOPs / peak); ``bytes_seconds`` and
    ``flops_seconds`` sum each term alone."""

    steps: int = 0
    tokens: int = 0
    sampled: int = 0
    weight_bytes: float = 0.0
    kv_read_bytes: float = 0.0
    kv_write_bytes: float = 0.0
    flops: float = 0.0
    seconds: float = 0.0
    bytes_seconds: float = 0.0
    flops_seconds: float = 0.0

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes

    def __iadd__(self, other: Floor) -> Floor:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    def record(self, prefix: str = "floor_") -> dict:
        """The floor as JSON fields (milliseconds for one step, seconds for several)."""
        scale, unit = (1e3, "ms") if self.steps == 1 else (1.0, "s")
        return {f"{prefix}{unit}": round(self.seconds * scale, 4),
                f"{prefix}bytes_only_{unit}": round(self.bytes_seconds * scale, 4),
                f"{prefix}flops_only_{unit}": round(self.flops_seconds * scale, 4),
                f"{prefix}weight_bytes": round(self.weight_bytes),
                f"{prefix}kv_read_bytes": round(self.kv_read_bytes),
                f"{prefix}kv_write_bytes": round(self.kv_write_bytes),
                f"{prefix}flops": round(self.flops), f"{prefix}steps": self.steps}


def step_floor(shape: dict, chunks: Sequence[tuple[int, int, bool]],
               bandwidth: float = H200_BANDWIDTH, peak: float = H200_PEAK, *,
               weight_bytes: int = 2, kv_bytes: int = 2, num_gpus: int = 1) -> Floor:
    """One engine step: ``chunks`` are (start, num_tokens, samples) per sequence: its tokens
    at positions start..start+num_tokens-1 go through the model, each attending every key up to
    its own; the chunk's K/V is read once (start + num_tokens keys); ``samples``: the chunk's
    last token is sampled (its logits computed). With ``num_gpus`` (tensor parallelism) each GPU
    takes an equal share of the bytes and FLOPs."""
    s = sizes(shape)
    tokens = sum(n for _, n, _ in chunks)
    sampled = sum(1 for _, _, samples in chunks if samples)
    layers_by_window = {w: s.windows.count(w) for w in set(s.windows)}
    # Per layer (summed over layers): keys read once per chunk, keys attended per token.
    keys = sum(count * keys_read(start, n, w) for w, count in layers_by_window.items()
               for start, n, _ in chunks)
    attended = sum(count * keys_attended(start, n, w) for w, count in layers_by_window.items()
                   for start, n, _ in chunks)
    touched = experts_touched(shape, tokens)
    weights = (s.layers * s.attention + s.num_dense_layers * s.dense_mlp
               + s.num_moe_layers * (s.router + touched * s.expert) + s.small
               + tokens * shape["hidden_size"] + (s.lm_head if sampled else 0))
    per_token = (s.layers * s.attention + s.num_dense_layers * s.dense_mlp
                 + s.num_moe_layers * (s.router + s.top_k * s.expert))
    flops = (2 * per_token * tokens + 2 * s.lm_head * sampled
             + 4 * s.attention_heads * s.head_dim * attended)
    floor = Floor(steps=1, tokens=tokens, sampled=sampled,
                  weight_bytes=weights * weight_bytes / num_gpus,
                  kv_read_bytes=keys * s.kv_per_token // s.layers * kv_bytes / num_gpus,
                  kv_write_bytes=tokens * s.kv_per_token * kv_bytes / num_gpus,
                  flops=flops / num_gpus)
    floor.bytes_seconds = floor.bytes / bandwidth
    floor.flops_seconds = floor.flops / peak
    floor.seconds = max(floor.bytes_seconds, floor.flops_seconds)
    return floor


def decode_step_floor(shape: dict, context_lens: Iterable[int], bandwidth: float = H200_BANDWIDTH,
                      peak: float = H200_PEAK, **options) -> Floor:
    """A decode step: one new token per sequence, sequence i attending ``context_lens[i]``
    keys (its cached tokens and the new one), every sequence sampling. ``options``: those of
    ``step_floor`` (weight_bytes, kv_bytes, num_gpus)."""
    return step_floor(shape, [(c - 1, 1, True) for c in context_lens], bandwidth, peak,
                      **options)


def latency_floor(shape: dict, context: int, bandwidth: float = H200_BANDWIDTH,
                  peak: float = H200_PEAK, new_tokens: int | None = None, **options) -> Floor:
    """Batch-1 decode after a prompt of ``context`` tokens: the decode step attending
    ``context`` keys; with ``new_tokens`` (N), the mean step of what latency.py times,
    (t(N) - t(1)) / (N - 1): the decode steps that attend context + 1 .. context + N - 1 keys
    (the first token comes from the prefill)."""
    if not new_tokens or new_tokens < 2:
        return decode_step_floor(shape, [context], bandwidth, peak, **options)
    total = Floor()
    for j in range(1, new_tokens):
        total += decode_step_floor(shape, [context + j], bandwidth, peak, **options)
    n = new_tokens - 1
    return Floor(steps=1, tokens=1, sampled=1, weight_bytes=total.weight_bytes / n,
                 kv_read_bytes=total.kv_read_bytes / n, kv_write_bytes=total.kv_write_bytes / n,
                 flops=total.flops / n, seconds=total.seconds / n,
                 bytes_seconds=total.bytes_seconds / n, flops_seconds=total.flops_seconds / n)


# ---- a workload -----------------------------------------------------------------------------

def schedule(requests: Sequence[tuple[int, int]], max_num_seqs: int = WORKLOAD_NUM_SEQS,
             max_num_batched_tokens: int = OFFLINE_MAX_NUM_BATCHED_TOKENS
             ) -> Iterable[list[tuple[int, int, bool]]]:
    """The steps the engine's scheduler runs for ``requests`` (prompt length, max_tokens),
    each as its chunks (start, num_tokens, samples), as ``Scheduler.schedule`` builds them:
    running requests first, oldest first (a decode token each, or the rest of a chunked
    prompt, within the step's token budget), then waiting ones admitted in order while the
    budget lasts and fewer than ``max_num_seqs`` run, a prompt split where the budget ends.
    As in the engine, which launches a step before the one before it has returned, a request
    that sampled its last token holds its place through the next step's scheduling. Assumes
    every request runs to max_tokens (ignore_eos), the KV cache holds them all (no
    preemption), no prefix-cache hits (random prompts) and steps one after another."""
    waiting = list(range(len(requests)))[::-1]  # a stack: the next request at the end
    length = [p for p, _ in requests]  # prompt + sampled tokens
    computed = [0] * len(requests)
    sampled = [0] * len(requests)
    running: list[int] = []
    while waiting or running:
        budget, chunks, scheduled = max_num_batched_tokens, [], []
        for r in running:
            if budget <= 0:
                break
            if sampled[r] >= requests[r][1]:
                continue  # its last token is still on the device: it holds its place a step
            n = min(length[r] - computed[r], budget)
            chunks.append((computed[r], n, computed[r] + n == length[r]))
            scheduled.append(r)
            budget -= n
        while waiting and budget > 0 and len(running) < max_num_seqs:
            r = waiting.pop()
            n = min(length[r], budget)
            chunks.append((0, n, n == length[r]))
            scheduled.append(r)
            running.append(r)
            budget -= n
        # The engine launches a step before the one before it returns: a request whose last
        # token that step sampled leaves only now, after the next step was scheduled.
        running = [r for r in running if sampled[r] < requests[r][1]]
        if chunks:
            yield chunks
        for r, (start, n, samples) in zip(scheduled, chunks):
            computed[r] = start + n
            if samples:
                sampled[r] += 1
                length[r] += 1


def workload_floor(shape: dict, requests: Sequence[tuple[int, int]],
                   bandwidth: float = H200_BANDWIDTH, peak: float = H200_PEAK, *,
                   max_num_seqs: int = WORKLOAD_NUM_SEQS,
                   max_num_batched_tokens: int = OFFLINE_MAX_NUM_BATCHED_TOKENS,
                   **options) -> Floor:
    """The floor of serving ``requests`` (prompt length, max_tokens) offline: the sum of each
    step's floor over the steps ``schedule`` simulates (continuous batching as the engine
    runs it: mixed prefill and decode steps under the token budget, contexts growing by one
    token a step). ``options``: those of ``step_floor`` (weight_bytes, kv_bytes, num_gpus)."""
    total = Floor()
    for chunks in schedule(requests, max_num_seqs, max_num_batched_tokens):
        total += step_floor(shape, chunks, bandwidth, peak, **options)
    return total


def throughput_requests(num_seqs: int = WORKLOAD_NUM_SEQS, max_input_len: int = 1024,
                        max_output_len: int = 1024, seed: int = 0
                        ) -> tuple[list[list[int]], list[int]]:
    """nano-vLLM's throughput workload: ``num_seqs`` prompts of randint(100, max_input_len)
    random ids in [0, 10000] and max_tokens randint(100, max_output_len), from ``seed``."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, max_input_len))]
               for _ in range(num_seqs)]
    max_tokens = [rng.randint(100, max_output_len) for _ in range(num_seqs)]
    return prompts, max_tokens


# ---- the device's ceilings ------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Ceilings:
    bandwidth: float  # B/s, bytes read + written by a device-to-device copy
    peak: float  # FLOP/s, a large bf16 matmul
    measured: bool

    def record(self) -> dict:
        return {"bandwidth_gbs": round(self.bandwidth / 1e9, 1),
                "matmul_tflops": round(self.peak / 1e12, 1), "ceilings_measured": self.measured}


DEFAULT_CEILINGS = Ceilings(H200_BANDWIDTH, H200_PEAK, measured=False)


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """B/s of a large device-to-device copy, counting the bytes read and written."""
    import torch

    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    elapsed = (time.perf_counter() - start) / iters
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / elapsed


def matmul_peak(n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of an n x n x n bf16 torch.matmul on random data (mean of ``iters`` after three)."""
    import torch

    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        a @ b
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        a @ b
    end.record()
    torch.cuda.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del a, b
    torch.cuda.empty_cache()
    return 2 * n ** 3 / seconds


@functools.lru_cache(maxsize=1)
def measure_ceilings() -> Ceilings:
    """The device's copy bandwidth and matmul peak, measured once per process; the H200's
    defaults without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return DEFAULT_CEILINGS
    return Ceilings(copy_bandwidth(), matmul_peak(), measured=True)


# ---- the self-check -------------------------------------------------------------------------

# A Llama-style shape small enough to count by hand.
CHECK_SHAPE = dict(architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   intermediate_size=128, vocab_size=1000, tie_word_embeddings=True)


def self_check() -> None:
    """The arithmetic against numbers counted by hand for CHECK_SHAPE (tests/test_floor.py)."""
    shape = CHECK_SHAPE
    # q = 4 * 16 = 64, kv = 2 * 16 = 32 features. A layer: qkv 64 * (64 + 2 * 32) = 8192,
    # o 64 * 64 = 4096, gate/up/down 3 * 64 * 128 = 24576: 36864 a layer, 73728 for two.
    # Norms: 2 * 64 a layer + 64 final = 320. LM head (tied) 1000 * 64 = 64000.
    assert parameters(shape) == 73728 + 320 + 64000
    # One token's K and V: 2 layers * 2 * 32 = 128 values, 256 bytes in bf16.
    assert sizes(shape).kv_per_token == 128
    # Decode, two sequences at 10 and 20 keys: weights 73728 + 320 + 64000 + 2 embedding rows
    # of 64 = 138176 values; KV read (10 + 20) * 256 = 7680 bytes, written 2 * 256 = 512.
    f = decode_step_floor(shape, [10, 20], bandwidth=1e9, peak=1e9)
    assert (f.weight_bytes, f.kv_read_bytes, f.kv_write_bytes) == (276352, 7680, 512), f
    # FLOPs: matrices 2 * 73728 * 2 tokens = 294912, LM head 2 * 64000 * 2 = 256000,
    # attention 4 * 4 heads * 16 * (10 + 20) keys * 2 layers = 15360.
    assert f.flops == 294912 + 256000 + 15360, f
    # 284544 bytes at 1 GB/s against 566272 FLOPs at 1 GFLOP/s: the FLOPs bind; at ten
    # times the peak, the bytes.
    assert abs(f.bytes_seconds - 284544 / 1e9) < 1e-15
    assert abs(f.flops_seconds - 566272 / 1e9) < 1e-15 and f.seconds == f.flops_seconds
    g = decode_step_floor(shape, [10, 20], bandwidth=1e9, peak=1e10)
    assert g.seconds == g.bytes_seconds == f.bytes_seconds
    # A prefill chunk of 5 tokens from position 0 that samples: keys attended 1+2+3+4+5 = 15,
    # K/V read for 5 keys once; weights with 5 embedding rows and the LM head.
    p = step_floor(shape, [(0, 5, True)], bandwidth=1e9, peak=1e9)
    assert p.flops == 2 * 73728 * 5 + 2 * 64000 + 4 * 4 * 16 * 15 * 2
    assert (p.weight_bytes, p.kv_read_bytes) == (2 * (73728 + 320 + 64000 + 5 * 64), 5 * 256)
    # A chunk that does not sample reads no LM head and computes no logits.
    c = step_floor(shape, [(0, 5, False)], bandwidth=1e9, peak=1e9)
    assert p.weight_bytes - c.weight_bytes == 2 * 64000 and p.flops - c.flops == 2 * 64000
    # Batch-1 latency after 100 tokens, 5 new ones timed: steps at 101..104 keys, mean 102.5.
    lat = latency_floor(shape, 100, bandwidth=1e9, peak=1e9, new_tokens=5)
    assert abs(lat.kv_read_bytes - 102.5 * 256) < 1e-9
    # The scheduler, counted by hand: budget 8 tokens, 2 sequences; requests (prompt, max
    # tokens) A (5, 2), B (6, 3), C (4, 1). Step 1: A's prompt (5, samples), B's first 3.
    # Step 2: A decodes (its last token), B's last 3 (samples). Step 3: B decodes; A still
    # holds its place, so C waits. Step 4: B decodes (done), C's prompt (samples, done).
    steps = list(schedule([(5, 2), (6, 3), (4, 1)], max_num_seqs=2, max_num_batched_tokens=8))
    assert steps == [[(0, 5, True), (0, 3, False)], [(5, 1, True), (3, 3, True)],
                     [(6, 1, True)], [(7, 1, True), (0, 4, True)]], steps
    w = workload_floor(shape, [(5, 2), (6, 3), (4, 1)], 1e9, 1e9, max_num_seqs=2,
                       max_num_batched_tokens=8)
    assert (w.steps, w.tokens, w.sampled) == (4, 18, 6), w
    assert abs(w.seconds - sum(step_floor(shape, s, 1e9, 1e9).seconds for s in steps)) < 1e-15
    # Mixture of experts: 8 experts, top 2: one token reads 2 experts a layer, two tokens
    # 8 * (1 - (6/8)^2) = 3.5 on average.
    moe = {**shape, "architectures": ["Qwen3MoeForCausalLM"], "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    assert experts_touched(moe, 1) == 2.0 and abs(experts_touched(moe, 2) - 3.5) < 1e-12
    m = decode_step_floor(moe, [10], bandwidth=1e9, peak=1e9)
    # A MoE layer: attention 12288, router 8 * 64 = 512, two experts of 3 * 64 * 32 = 6144;
    # norms 2 * (2 * 64 + 2 * 16 q/k norm) + 64 = 384.
    assert m.weight_bytes == 2 * (2 * (12288 + 512 + 2 * 6144) + 384 + 64 + 64000), m
    # Tensor parallelism halves each GPU's share.
    assert decode_step_floor(shape, [10, 20], 1e9, 1e9, num_gpus=2).bytes == f.bytes / 2
    # Sliding windows of 8 keys on one of the two layers (Gemma 2's alternation): decoding
    # at 20 keys reads 8 there, 20 on the other; a 5-token chunk from 6 attends 7 + 8 * 4.
    windowed = {**shape, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2",
                "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]}
    assert sizes(windowed).windows == (8, 0)
    assert decode_step_floor(windowed, [20], 1e9, 1e9).kv_read_bytes == (8 + 20) * 128
    chunk = step_floor(windowed, [(6, 5, True)], 1e9, 1e9)
    assert chunk.kv_read_bytes == (min(11, 8 + 4) + 11) * 128
    assert chunk.flops - p.flops == 2 * 73728 * 0 + 4 * 4 * 16 * (
        (7 + 8 * 4) + (7 + 8 + 9 + 10 + 11) - 2 * 15)
    assert keys_attended(0, 5, 3) == 1 + 2 + 3 + 3 + 3 and keys_attended(10, 2, 3) == 6
    print("floor.py self-check passed", file=sys.stderr)


def engine_schedule_check() -> None:
    """``schedule`` against the engine's own scheduler, chunk for chunk: a tiny random model on
    the CPU serves three small workloads (needs nanoserve; movable into tests/)."""
    import tempfile
    from pathlib import Path

    from nanoserve.bench.shapes import SHAPES, make_model_dir

    from nanoserve import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as tmp:  # a vocabulary just past the prompts' ids
        model_dir = make_model_dir({**SHAPES["tiny-qwen3"], "vocab_size": 10240},
                                   Path(tmp) / "tiny")
        rng = random.Random(0)
        for num_seqs, max_num_seqs, budget in ((10, 3, 48), (12, 5, 20), (6, 8, 16384)):
            # Prompts longer than the budget split; more requests than seats wait.
            prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(5, 60))]
                       for _ in range(num_seqs)]
            max_tokens = [rng.randint(1, 30) for _ in range(num_seqs)]
            llm = LLM(str(model_dir), load_format="dummy", device="cpu",
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
            scheduler, seen = llm.engine.scheduler, []
            plain = scheduler.schedule

            def recorded():
                out = plain()
                if out.chunks:
                    seen.append(sorted((c.start, c.num_tokens, c.samples) for c in out.chunks))
                return out

            scheduler.schedule = recorded
            llm.generate(prompts, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=n)
                                   for n in max_tokens], use_tqdm=False)
            llm.close()
            simulated = [sorted(chunks) for chunks in schedule(
                [(len(p), n) for p, n in zip(prompts, max_tokens)], max_num_seqs, budget)]
            assert seen == simulated, (num_seqs, max_num_seqs, budget, len(seen), len(simulated))
    print("floor.py: the simulated schedule is the engine's", file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    import argparse

    from nanoserve.bench.shapes import SHAPES

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shapes", nargs="*", metavar="SHAPE",
                        help=f"print these shapes' floors (H200 defaults): {', '.join(SHAPES)}")
    parser.add_argument("--engine", action="store_true",
                        help="also check the simulated schedule against the engine's (CPU)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.shapes if name not in SHAPES]
    if unknown:
        parser.error(f"unknown shapes {unknown}; known: {', '.join(sorted(SHAPES))}")
    self_check()
    if args.engine:
        engine_schedule_check()
    prompts, max_tokens = throughput_requests()
    requests = [(len(p), n) for p, n in zip(prompts, max_tokens)]
    for name in args.shapes:
        shape = SHAPES[name]
        work = workload_floor(shape, requests)
        print(json.dumps({"shape": name, "parameters": parameters(shape),
                          **{f"latency_{c}_ms": round(latency_floor(shape, c, new_tokens=128)
                                                      .seconds * 1e3, 4)
                             for c in (128, 2048, 8192)},
                          "workload_floor_tok_s": round(sum(max_tokens) / work.seconds),
                          "workload_bytes_floor_tok_s": round(sum(max_tokens)
                                                              / work.bytes_seconds),
                          **work.record()}))


if __name__ == "__main__":
    main()
