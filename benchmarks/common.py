"""Shared benchmark helpers: model folders of real shapes, device bandwidth, CUDA-graph timing,
profiler kernel time, JSON output."""
from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

# Qwen3-0.6B and Qwen3-8B shapes (config.json fields), random weights.
SHAPES = {
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                       num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, intermediate_size=3072, vocab_size=151936,
                       tie_word_embeddings=True, rope_theta=1e6, rms_norm_eps=1e-6,
                       max_position_embeddings=40960, torch_dtype="bfloat16",
                       eos_token_id=151645, bos_token_id=151643, hidden_act="silu"),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=128, intermediate_size=12288, vocab_size=151936,
                     tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6,
                     max_position_embeddings=40960, torch_dtype="bfloat16",
                     eos_token_id=151645, bos_token_id=151643, hidden_act="silu"),
    # Llama-3.2-1B's shape: head_dim 64, llama3 rope scaling.
    "llama-1b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048,
                     num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                     head_dim=64, intermediate_size=8192, vocab_size=128256,
                     tie_word_embeddings=True, rope_theta=500000.0, rms_norm_eps=1e-5,
                     max_position_embeddings=131072, torch_dtype="bfloat16",
                     rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192},
                     eos_token_id=128001, bos_token_id=128000, hidden_act="silu"),
}

# Qwen3-30B-A3B's layer shape (128 experts, top 8, 768 intermediate features each) in 4 layers:
# big enough to route like the real model, small enough to save and load within a device call.
SHAPES["qwen3-moe-small"] = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048,
    num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936,
    tie_word_embeddings=False, rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=40960,
    torch_dtype="bfloat16", eos_token_id=151645, bos_token_id=151643, hidden_act="silu")

# Qwen3-30B-A3B's whole shape (48 layers, ~61 GB in bf16): random weights on the device only.
SHAPES["qwen3-30b-a3b"] = {**SHAPES["qwen3-moe-small"], "num_hidden_layers": 48}

# Qwen3-0.6B's layers, two of them: the batch-1 layer kernel against the Triton layers
# (tests/gpu/test_layer_chain_gpu.py) without 28 layers of rounding between them.
SHAPES["qwen3-0.6b-2layers"] = {**SHAPES["qwen3-0.6b"], "num_hidden_layers": 2}

# Qwen3-0.6B's config shrunk to one small layer: for host-side benchmarks, whose model forward
# must cost next to nothing.
SHAPES["tiny-qwen3"] = {**SHAPES["qwen3-0.6b"], **dict(
    hidden_size=64, num_hidden_layers=1, intermediate_size=128, head_dim=32,
    num_attention_heads=2, num_key_value_heads=1)}

QWEN3_TOKENIZER_DIR = Path(".cache/qwen3-tokenizer")


class GCTimer:
    """Python's garbage collections while active: per generation, how many and how long."""

    def __init__(self) -> None:
        self.counts, self.ms, self._start = [0, 0, 0], [0.0, 0.0, 0.0], 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.ms[info["generation"]] += (time.perf_counter() - self._start) * 1e3

    def report(self) -> dict:
        return {"collections": self.counts, "ms": [round(t, 2) for t in self.ms]}


def make_model_dir(shape: str, out: Path, tokenizer_dir: Path = QWEN3_TOKENIZER_DIR) -> Path:
    """A model folder with config.json and a tokenizer, for `load_format="dummy"`."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(SHAPES[shape], indent=1))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    return out


def save_random_hf_model(shape: str, out: Path, seed: int = 0) -> Path:
    """Random bf16 weights saved by transformers, so both engines load the very same tensors."""
    from transformers import AutoConfig, AutoModelForCausalLM

    make_model_dir(shape, out)
    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(out)
    del model
    torch.cuda.empty_cache()
    return out


def weight_bytes(shape: dict) -> int:
    """bf16 bytes a decode step reads: every layer's matrices plus the LM head. A
    mixture-of-experts layer counts its router and the top-k experts one token reads, the
    least a step reads (a lower bound for batches whose tokens pick different experts)."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    mlp = 3 * h * i
    if shape.get("num_experts"):  # every layer sparse in the shapes here
        mlp = shape["num_experts"] * h + shape["num_experts_per_tok"] * 3 * h * \
            shape["moe_intermediate_size"]
    return 2 * (layers * (h * (q + 2 * kv) + q * h + mlp) + shape["vocab_size"] * h)


def copy_bandwidth_gbs(nbytes: int = 4 << 30, iters: int = 20) -> float:
    """Device memory bandwidth measured as bytes read + written by a large copy."""
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
    return 2 * nbytes / elapsed / 1e9


def environment() -> dict[str, str]:
    import triton
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = ""
    return {"device": gpu, "driver": driver, "torch": torch.__version__,
            "cuda": str(torch.version.cuda), "triton": triton.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d")}


def emit(record: dict) -> None:
    print(json.dumps(record), flush=True)


def graph_us(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Microseconds per call, with ``calls`` captured back to back in one CUDA graph (the way
    the engine launches decode, so launch cost counts as it does there)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for call in calls[:3]:  # compiles and settles allocations outside the capture
            call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return replay_ms(graph, replays) * 1e3 / len(calls)


def timed_ms(fn: Callable[[], object], iters: int = 10, repeats: int = 3) -> float:
    """Best over ``repeats`` of the mean milliseconds of ``iters`` back-to-back eager calls
    (after one untimed call)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Milliseconds per replay of ``graph``, replayed back to back (after one untimed replay)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


# ~0.2 s of GPU sleep on an H200: longer than any host-timed loop queued behind it.
SLEEP_CYCLES = 400_000_000


def host_us(fn: Callable[[], object], calls: int = 1) -> float:
    """Host microseconds per call of ``fn``, queued behind a sleep kernel so that no call waits
    for the device to finish earlier work (one that does shows as ~200,000 us)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    return round(elapsed, 1)


def kernel_us(events: list) -> float:
    """Device time of the CUDA kernels among torch.profiler ``events`` (``key_averages()``).

    Under programmatic dependent launch a kernel's time runs from its early start, waiting
    included, so kernel times overlap and their sum exceeds the device's busy time: this says
    so on stderr, with the way to get additive times.
    """
    from nanoserve.kernels.common import programmatic_launch

    if programmatic_launch(torch.device("cuda")):
        print("programmatic launch is on: kernel times include waiting and overlap; "
              "NANOSERVE_DISABLE_PDL=1 gives additive times", file=sys.stderr)
    return sum(e.self_device_time_total for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA)
