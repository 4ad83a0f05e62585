"""A batch-1 decode step from its token to its logits in one launch of a persistent CUDA
kernel.

At batch 1 a layer's GEMVs read ~31 MB of weights in a handful of microseconds, and the
Triton chain of six launches per layer spends much of its time between them: each kernel
waits for the last before it streams its weights. ``layer_chain.cu`` keeps one block per SM
alive for all layers; a warp per block streams the block's weight slices of every layer into
shared memory as far ahead as its ring allows, while the other warps compute and hand their
outputs to the next stage through tagged words instead of launches (docs/kernels.md,
"Batch-1 layers as one persistent CUDA kernel"). It reads the token's embedding row itself,
and after the last layer it normalises the residual and scores the vocabulary, the LM head's
weights streaming in while the last layer still computes. It runs the engine's tensors as
they are:
the folded weights, the paged K/V caches, RoPE's table, the step's position and block table
in device memory, so one CUDA graph serves every step.

The kernel is written for one shape, Qwen3-0.6B's layers, on sm_90; ``attach_layer_chain``
logs why another model or device keeps the Triton path, and steps with more than
``MAX_KEYS`` keys keep it too (``runs_step``).
"""
from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.config import ModelConfig
from nanoserve.kernels.cuda_build import (CudaBuildError, CudaDriverError, CudaKernel,
                                          available_compiler, build_cubin)

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_suffix(".cu")
# The kernel's constants: the layer shape it is written for.
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 1024, 16, 8, 128, 3072
QKV = (HEADS + 2 * KV_HEADS) * HEAD_DIM
# Its default tuning: attention in SPLITS splits per KV head, each of up to
# CONSUMER_WARPS * KEYS_PER_WARP keys; a ring of SLOTS shared-memory slots per block.
SPLITS, CONSUMER_WARPS, KEYS_PER_WARP, SLOTS, SLOT_BYTES = 16, 8, 4, 13, 16384
MAX_KEYS = SPLITS * CONSUMER_WARPS * KEYS_PER_WARP
MIN_GRID = 128  # the kernel refuses fewer blocks: they bound the rows a warp holds
PARTIAL = HEAD_DIM + 2  # a split's (max, sum, output) per q head


class Weights(ctypes.Structure):
    """The kernel's ``Weights``: per matrix, a device array of each layer's pointer."""

    _fields_ = [(name, ctypes.c_void_p) for name in ("qkv", "o", "gate_up", "down")]


class AttentionArgs(ctypes.Structure):
    """The kernel's ``AttentionArgs``, passed by value (``context`` is the kernel's to fill)."""

    _fields_ = [("k_caches", ctypes.c_void_p), ("v_caches", ctypes.c_void_p),
                ("block_table", ctypes.c_void_p), ("position", ctypes.c_void_p),
                ("context", ctypes.c_int), ("block_size", ctypes.c_int),
                ("cos_sin", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("partials", ctypes.c_void_p),
                ("head_done", ctypes.c_void_p), ("out", ctypes.c_void_p)]


class TaggedArgs(ctypes.Structure):
    """The kernel's ``TaggedArgs``: the buffers stages hand data on in, and the launch count."""

    _fields_ = [(name, ctypes.c_void_p) for name in
                ("qkv", "partials", "attn", "residual_o", "act", "residual_down", "epoch")]


class Vocab(ctypes.Structure):
    """The kernel's ``Vocab``: the step's token and embedding, the final norm and LM head it
    runs after the layers, where the final hidden state and logits go, and the greedy pick's
    counters and token (null: no pick) (VOCAB=1; all zero for builds without)."""

    _fields_ = ([(name, ctypes.c_void_p) for name in
                 ("token_index", "tokens", "embed", "head", "norm", "normed", "logits",
                  "greedy_state", "greedy_token", "host_token")]
                + [("size", ctypes.c_int)])


class GreedyPick(NamedTuple):
    """Where a forward that runs the kernel writes the argmax of the logits it scores: ``out``
    (int64 [1], on the device), and where ``host_address`` (a device int64 [1], may be None)
    holds the nonzero address of pinned host memory, there too, so that the step's token
    reaches the host with no copy of its own."""

    out: torch.Tensor
    host_address: torch.Tensor | None = None


def pointer_array(tensors: list[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """A device array of the tensors' addresses: how the kernel takes a matrix or cache per
    layer."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64, device=device)


def tagged_buffers(device: torch.device | str, max_splits: int = 32) -> dict[str, torch.Tensor]:
    """The tagged exchange buffers in 32-bit words, zeroed (no word carries a tag yet);
    partials are 64-bit words, room for ``max_splits`` splits."""
    def words(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.int32, device=device)

    return {"qkv": words(QKV), "partials": words(2 * HEADS * max_splits * PARTIAL),
            "attn": words(HEADS * HEAD_DIM), "residual_o": words(HIDDEN),
            "act": words(INTERMEDIATE), "residual_down": words(HIDDEN), "epoch": words(1)}


def model_unsupported_reason(cfg: ModelConfig, dtype: torch.dtype,
                             kv_cache_dtype: torch.dtype, tp_size: int) -> str | None:
    """Why the kernel cannot run this model's layers as configured; None when it can."""
    shape = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
             cfg.intermediate_size)
    if tp_size != 1:
        return "tensor parallelism"
    if dtype != torch.bfloat16 or kv_cache_dtype != torch.bfloat16:
        return "the kernel reads bf16 weights and a bf16 K/V cache"
    if shape != (HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE):
        return (f"the kernel is written for Qwen3-0.6B's layers (hidden {HIDDEN}, {HEADS} "
                f"heads, {KV_HEADS} KV heads, head_dim {HEAD_DIM}, intermediate "
                f"{INTERMEDIATE})")
    if not cfg.qk_norm or cfg.attention_bias or cfg.moe_layers:
        return "the kernel's layer has q/k norms, no biases and a dense MLP (Qwen3)"
    return None


def device_unsupported_reason(device: torch.device) -> str | None:
    """Why the kernel cannot run on ``device``; None when it can."""
    if device.type != "cuda":
        return "not a CUDA device"
    if torch.cuda.get_device_capability(device) != (9, 0):
        return "the kernel's bulk copies are written for sm_90 (H100/H200)"
    if torch.cuda.get_device_properties(device).multi_processor_count < MIN_GRID:
        return f"the kernel needs at least {MIN_GRID} SMs"
    if float(os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", 100)) < 100:
        return "MPS gives this process part of the SMs; the kernel needs a block on each at once"
    if available_compiler() is None:
        return "no CUDA compiler (nvcc, or the nvidia-cuda-nvrtc wheel)"
    return None


def runs_step(ids: torch.Tensor, meta: AttentionMetadata) -> bool:
    """Whether the kernel runs this forward: one sequence, one new token, at most MAX_KEYS
    keys (a decode graph's context cap, or the step's own longest context)."""
    return ids.shape[0] == 1 and meta.max_query_len == 1 and runs_decode(1, meta.max_seq_len)


def runs_decode(num_seqs: int, max_seq_len: int) -> bool:
    """Whether the kernel runs a decode step of ``num_seqs`` sequences whose longest context
    (or graph's cap) is ``max_seq_len``."""
    return num_seqs == 1 and max_seq_len <= MAX_KEYS


class LayerChain:
    """Runs a decoder's layers, final norm and LM head for one decode token as one launch.

    Holds what the kernel reads beside the model's own tensors: a device array of each
    layer's weight and cache pointers, float32 copies of the q/k and final norm weights, and
    the tagged exchange buffers, whose launch count lives on the device so that graph replays
    get fresh tags; and what it writes: the final hidden state, the logits and, where asked,
    the greedy token. The model's weights must already carry their pre-norms
    (``fold_norm_weights``).
    """

    def __init__(self, causal_lm: torch.nn.Module, eps: float):
        model = causal_lm.model
        layers = model.layers
        device = model.embed_tokens.weight.device
        self.grid = torch.cuda.get_device_properties(device).multi_processor_count
        cubin, self.resources = build_cubin(SOURCE, {"VOCAB": "1"})
        self.kernel = CudaKernel(cubin, "layer_chain", 32 * (CONSUMER_WARPS + 1),
                                 SLOTS * SLOT_BYTES, device)
        if self.kernel.blocks_per_sm() < 1:
            raise CudaDriverError(f"layer_chain does not fit an SM: {self.resources}")
        self.eps, self.num_layers, self.device = eps, len(layers), device

        self.attention_layers = [layer.self_attn for layer in layers]
        self.weight_pointers = [pointer_array([layer.get_submodule(name).weight
                                               for layer in layers], device)
                                for name in ("self_attn.qkv_proj", "self_attn.o_proj",
                                             "mlp.gate_up_proj", "mlp.down_proj")]
        self.q_norm = torch.stack([a.q_norm.weight.float() for a in self.attention_layers])
        self.k_norm = torch.stack([a.k_norm.weight.float() for a in self.attention_layers])
        self.cos_sin = self.attention_layers[0].rotary.cos_sin
        self.tagged = tagged_buffers(device)
        # The plain buffers and counters of the kernel's barrier build (TAGGED=0), which its
        # signature takes in every build; the tagged build leaves them be.
        self.plain = {name: torch.empty(n, dtype=torch.bfloat16, device=device)
                      for name, n in (("qkv", QKV), ("act", INTERMEDIATE),
                                      ("attn", HEADS * HEAD_DIM))}
        self.partials = torch.empty(HEADS * SPLITS * PARTIAL, device=device)
        self.embed = model.embed_tokens.weight
        self.head_weight = causal_lm.lm_head.weight
        self.vocab = causal_lm.lm_head.vocab_size
        self.final_norm = model.norm.weight.float()
        self.residual = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device=device)
        self.first_row = torch.zeros(1, dtype=torch.int64, device=device)
        self.normed = torch.empty(1, HIDDEN, dtype=torch.bfloat16, device=device)
        self.logits = torch.empty(1, self.vocab, dtype=torch.bfloat16, device=device)
        self.counters = torch.zeros(1 + KV_HEADS, dtype=torch.int32, device=device)
        self.greedy_state = torch.zeros(2, dtype=torch.int64, device=device)
        self.failed = torch.zeros(1, dtype=torch.int32, device=device)
        self.cache_pointers: tuple[torch.Tensor, torch.Tensor] | None = None
        self._cache_addresses: list[int] = []
        self.block_size = 0  # the caches', once bound

    def _bind_caches(self) -> None:
        """Point the kernel at the layers' current K/V caches (the runner re-allocates them
        while it sizes the cache; graphs are captured after, with the final ones)."""
        addresses = [t.data_ptr() for a in self.attention_layers for t in (a.k_cache, a.v_cache)]
        if addresses != self._cache_addresses:
            self.cache_pointers = (
                pointer_array([a.k_cache for a in self.attention_layers], self.device),
                pointer_array([a.v_cache for a in self.attention_layers], self.device))
            self._cache_addresses = addresses
            self.block_size = self.attention_layers[0].k_cache.shape[1]

    def __call__(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 token_table: torch.Tensor | None = None,
                 greedy: GreedyPick | None = None) -> torch.Tensor:
        """The final hidden state (after the last norm; ``normed``, [1, HIDDEN] bf16) of the
        token ``ids`` ([1]), or with ``token_table`` (int64) of ``token_table[ids]``; stores the
        token's K/V in the cache, its logits in ``logits`` and the residual stream after the
        last layer in ``residual``; with ``greedy``, the logits' argmax where it says (the
        lowest index among equals, as ``sample_tokens`` picks at temperature 0)."""
        self._bind_caches()
        for name, t in (("greedy.out", greedy and greedy.out),
                        ("greedy.host_address", greedy and greedy.host_address)):
            if t is not None and (t.shape != (1,) or t.dtype != torch.int64
                                  or t.device != self.device):
                raise ValueError(f"{name} must be one int64 on {self.device}, got "
                                 f"{tuple(t.shape)} {t.dtype} on {t.device}")
        tables = meta.block_tables
        if positions.dtype != torch.int64 or tables.dtype != torch.int32 or tables.stride(-1) != 1:
            raise ValueError("layer_chain reads int64 positions and an int32 block table row")
        if token_table is None:
            token_table, ids = ids.to(torch.int64), self.first_row
        elif token_table.dtype != torch.int64 or ids.dtype != torch.int64:
            raise ValueError("layer_chain reads an int64 token table and index")
        attention = AttentionArgs(
            self.cache_pointers[0].data_ptr(), self.cache_pointers[1].data_ptr(),
            tables.data_ptr(), positions.data_ptr(), 0, self.block_size,
            self.cos_sin.data_ptr(), self.q_norm.data_ptr(), self.k_norm.data_ptr(),
            self.partials.data_ptr(), self.counters[1:].data_ptr(),
            self.plain["attn"].data_ptr())
        self.kernel.launch(self.grid, [
            Weights(*(p.data_ptr() for p in self.weight_pointers)), self.residual.data_ptr(),
            self.plain["qkv"].data_ptr(), self.plain["act"].data_ptr(), attention,
            TaggedArgs(*(t.data_ptr() for t in self.tagged.values())),
            Vocab(ids.data_ptr(), token_table.data_ptr(), self.embed.data_ptr(),
                  self.head_weight.data_ptr(),
                  self.final_norm.data_ptr(), self.normed.data_ptr(), self.logits.data_ptr(),
                  self.greedy_state.data_ptr(), 0 if greedy is None else greedy.out.data_ptr(),
                  0 if greedy is None or greedy.host_address is None
                  else greedy.host_address.data_ptr(),
                  self.vocab),
            self.counters.data_ptr(), self.failed.data_ptr(), 0,
            ctypes.c_int(self.num_layers), ctypes.c_float(self.eps)])
        return self.normed

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits the last launch scored, where ``hidden`` is its output; else None."""
        return self.logits if hidden is self.normed else None

    def has_failed(self) -> bool:
        """Whether a launch gave up waiting (a bug, or blocks that could not all be resident);
        its outputs are then wrong. Synchronises."""
        return bool(self.failed.item())


def attach_layer_chain(model: torch.nn.Module, cfg: ModelConfig, dtype: torch.dtype,
                       kv_cache_dtype: torch.dtype, device: torch.device, tp_size: int) -> None:
    """Give ``model`` (a DecoderForCausalLM) a LayerChain for its batch-1 decode steps where
    the kernel supports the model and device; otherwise log why and leave it on Triton. A
    kernel that does not build or load (an old compiler, a driver that refuses it) is a
    warning, not a failed start: the Triton path runs every step anyway."""
    reason = (model_unsupported_reason(cfg, dtype, kv_cache_dtype, tp_size)
              or device_unsupported_reason(device))
    if reason is not None:
        logger.info("batch-1 decode keeps the Triton kernels: %s", reason)
        return
    try:
        chain = LayerChain(model, cfg.rms_norm_eps)
    except (CudaBuildError, CudaDriverError) as e:
        logger.warning("batch-1 decode keeps the Triton kernels: layer_chain.cu did not "
                       "build or load: %s", e)
        return
    model.model.layer_chain = chain
    logger.info("batch-1 decode steps of up to %d keys run layer_chain.cu (%s)", MAX_KEYS,
                "; ".join(chain.resources))
