"""Quantized weights kept quantized: each format's unpacking bit-exact against a dequantization
written here from the format's description (GGUF's also against the ``gguf`` package's), the
packed matmuls against float64, tensor-parallel slices of packed weights, and whole models
(the SmolLM2 Q4_1 GGUF, tiny AWQ / GPTQ checkpoints quantized here) against the same engine
on the dequantized weights: greedy tokens equal, or at the first divergence each side's token
in the other's top-5; logprobs close before it."""
from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from nanoserve import LLM, SamplingParams
from nanoserve.attention.torch_backend import TorchAttentionBackend
from nanoserve.config import ModelConfig
from nanoserve.layers.parallel_state import tensor_parallel_group
from nanoserve.layers.quantization.gguf_blocks import BLOCK_TYPES, unpack_blocks
from nanoserve.layers.quantization.gptq_awq import AWQ_ORDER, awq_weight, gptq_weight
from nanoserve.layers.quantization.methods import quantized_linears
from nanoserve.layers.quantization.packed import (GroupedInts, GroupedMatrix, Int4Matrix,
                                                  pack_for_matmul)
from nanoserve.layers.quantization.spec import resolve_quant_spec
from nanoserve.models.loader import iter_weights, load_model_assets
from nanoserve.models.registry import build_model

GEN = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, logprobs=5)
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there"]


# --- GGUF blocks ---------------------------------------------------------------------------

def _random_blocks(type_name: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes as ``type_name`` blocks, their half-float scales made finite and small."""
    per_block, nbytes = BLOCK_TYPES[type_name][:2]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // per_block, nbytes), dtype=np.uint8)
    halves = {"Q6_K": [208], "Q8_0": [0], "Q4_0": [0]}.get(type_name, [0, 2])
    for at in halves:
        d = rng.uniform(-0.05, 0.05, (rows, cols // per_block, 1)).astype(np.float16)
        raw[..., at:at + 2] = d.view(np.uint8)
    return raw.reshape(rows, -1)


def _reference_q4_q8(raw: np.ndarray, type_name: str) -> torch.Tensor:
    """ggml-quants.c, one block at a time: Q4_0 ``d * (q - 8)``, Q4_1 ``d * q + m`` (low
    nibbles are values 0-15, high ones 16-31), Q8_0 ``d * q`` (signed bytes)."""
    nbytes = BLOCK_TYPES[type_name][1]
    out = []
    for block in raw.reshape(-1, nbytes):
        d = torch.tensor(block[:2].view(np.float16).astype(np.float32))
        if type_name == "Q8_0":
            out.append(torch.tensor(block[2:].view(np.int8).astype(np.float32)) * d)
            continue
        qs = torch.tensor(block[-16:].astype(np.int64))
        q = torch.cat([qs & 15, qs >> 4]).float()
        if type_name == "Q4_0":
            out.append(d * (q - 8))
        else:
            out.append(d * q + torch.tensor(block[2:4].view(np.float16).astype(np.float32)))
    return torch.cat(out).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("type_name", list(BLOCK_TYPES))
def test_gguf_blocks_unpack_bit_exact(type_name):
    rows, cols = 4, 512
    raw = _random_blocks(type_name, rows, cols)
    w = unpack_blocks(torch.from_numpy(raw), type_name, cols)
    ours = w.dequantize()
    theirs = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[type_name])
    assert torch.equal(ours, torch.from_numpy(theirs))
    if type_name in ("Q4_0", "Q4_1", "Q8_0"):
        assert torch.equal(ours, _reference_q4_q8(raw, type_name))
    assert w.four_bit == (type_name in ("Q4_0", "Q4_1", "Q4_K"))
    if w.four_bit:
        assert int(w.codes.min()) >= 0 and int(w.codes.max()) <= 15


def test_unsupported_gguf_type_is_named():
    with pytest.raises(ValueError, match="Q2_K.*supported: Q4_0, Q4_1, Q8_0"):
        unpack_blocks(torch.zeros(1, 84, dtype=torch.uint8), "Q2_K", 256)


@pytest.mark.parametrize("types,packed", [(("Q4_K", "Q4_0", "Q4_1"), Int4Matrix),
                                          (("Q4_K", "Q8_0", "Q6_K"), GroupedMatrix)])
def test_gguf_qkv_of_mixed_types_matches_dequantized(types, packed):
    """q, k and v in different GGUF types (as Q4_K_M files mix them) stack into one matrix."""
    from nanoserve.layers.linear import QKVParallelLinear
    from nanoserve.layers.quantization.methods import RawBlocks, RawNarrow
    from nanoserve.layers.quantization.spec import QuantSpec

    with quantized_linears(QuantSpec("gguf")):
        qkv = QKVParallelLinear(256, 64, 4, 2)
    param, dense = qkv.weight, []
    for seed, (shard, type_name) in enumerate(zip("qkv", types)):
        raw = _random_blocks(type_name, 256 if shard == "q" else 128, 256, seed)
        assert isinstance(qkv.checkpoint_slice(param, shard), RawNarrow)
        qkv.weight_loader(param, RawBlocks(torch.from_numpy(raw), type_name, 256), shard)
        dense.append(torch.from_numpy(gguf.quants.dequantize(
            raw, gguf.GGMLQuantizationType[type_name])))
    assert isinstance(qkv.packed, packed)
    x = torch.randn(3, 256)
    want = x.double() @ torch.cat(dense).double().t()
    tol = 2e-2 if packed is Int4Matrix else 1e-5  # the CPU int4 kernel computes in bfloat16
    torch.testing.assert_close(qkv(x).double(), want, rtol=tol, atol=tol * want.abs().max())


# --- packed matmuls ------------------------------------------------------------------------

def _grouped(n: int, k: int, g: int, four_bit: bool, seed: int = 0) -> GroupedInts:
    gen = torch.Generator().manual_seed(seed)
    lo, hi = (0, 16) if four_bit else (-128, 128)
    codes = torch.randint(lo, hi, (n, k), generator=gen).to(torch.int8)
    scales = torch.rand(n, k // g, generator=gen) * 0.02 + 0.001
    offsets = torch.randn(n, k // g, generator=gen) * 0.05
    return GroupedInts(codes, scales, offsets, g, four_bit)


@pytest.mark.parametrize("n,k,g,four_bit", [(64, 256, 32, True), (48, 256, 128, True),
                                            (20, 64, 32, True), (40, 96, 16, False)])
def test_packed_matmul_matches_float64(n, k, g, four_bit):
    w = _grouped(n, k, g, four_bit)
    x = torch.randn(5, k)
    want = x.double() @ w.dequantize().double().t()
    matrix = pack_for_matmul(w, torch.float32)
    assert isinstance(matrix, Int4Matrix if four_bit else GroupedMatrix)
    got = matrix.matmul(x)
    assert got.dtype == torch.float32 and got.shape == (5, n)
    # The CPU int4 kernel computes in bfloat16 (scales and activations rounded).
    tol = 2e-2 if isinstance(matrix, Int4Matrix) and matrix.cpu_packed is not None else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol * want.abs().max())


def test_act_order_permutation_is_undone():
    w = _grouped(32, 128, 32, True)
    w.perm = torch.randperm(128, generator=torch.Generator().manual_seed(1))
    x = torch.randn(3, 128)
    want = x.double() @ w.dequantize().double().t()
    got = pack_for_matmul(w, torch.float32).matmul(x)
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2 * want.abs().max())


# --- AWQ / GPTQ layouts (packed here as AutoAWQ and AutoGPTQ do) ---------------------------

def _quantize_rtn(w: torch.Tensor, g: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric 4-bit round-to-nearest of ``w`` ``[N, K]`` per group of ``g`` inputs: codes
    ``[K, N]``, zero points and half-float scales ``[K / g, N]``."""
    n, k = w.shape
    groups = w.t().reshape(k // g, g, n)
    lo, hi = groups.amin(1), groups.amax(1)
    scales = ((hi - lo).clamp(min=1e-5) / 15).half()
    zeros = (-lo / scales.float()).round().clamp(0, 15)
    q = (groups / scales.float()[:, None] + zeros[:, None]).round().clamp(0, 15)
    return q.reshape(k, n).int(), zeros.int(), scales


def _pack_along(values: torch.Tensor, order: tuple[int, ...], dim: int) -> torch.Tensor:
    """int32 words of 8 nibbles: word ``c`` holds entry ``8c + order[i]`` in nibble ``i``."""
    values = values.movedim(dim, -1)
    packed = torch.zeros(*values.shape[:-1], values.shape[-1] // 8, dtype=torch.int64)
    for i, j in enumerate(order):
        packed |= values[..., j::8].long() << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return packed.movedim(-1, dim).contiguous()


def awq_pack(w: torch.Tensor, g: int) -> dict[str, torch.Tensor]:
    q, z, s = _quantize_rtn(w, g)
    return {"qweight": _pack_along(q, AWQ_ORDER, 1), "qzeros": _pack_along(z, AWQ_ORDER, 1),
            "scales": s}


def gptq_pack(w: torch.Tensor, g: int, act_order: bool, seed: int = 0) -> dict[str, torch.Tensor]:
    """AutoGPTQ v1: input features quantized in ``perm``'s order (act order), groups of ``g``
    consecutive ones there; zero points stored minus one."""
    k = w.shape[1]
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(seed)) if act_order \
        else torch.arange(k)
    q, z, s = _quantize_rtn(w[:, perm], g)
    g_idx = torch.empty(k, dtype=torch.int32)
    g_idx[perm] = (torch.arange(k) // g).int()
    codes = torch.empty_like(q)
    codes[perm] = q
    return {"qweight": _pack_along(codes, tuple(range(8)), 0),
            "qzeros": _pack_along(z - 1, tuple(range(8)), 1), "scales": s, "g_idx": g_idx}


def _reference_dequant(t: dict[str, torch.Tensor], method: str, g: int) -> torch.Tensor:
    """``W[n, k] = (q[k, n] - z[group(k), n]) * s[group(k), n]``, nibble by nibble."""
    k = t["qweight"].shape[0] * (8 if method == "gptq" else 1)
    n = t["scales"].shape[1]
    order = AWQ_ORDER if method == "awq" else tuple(range(8))
    w = torch.empty(n, k)
    qw, qz = t["qweight"].long() & 0xFFFFFFFF, t["qzeros"].long() & 0xFFFFFFFF
    for col in range(n):
        zword, znib = col // 8, order.index(col % 8)
        for row in range(k):
            group = int(t["g_idx"][row]) if method == "gptq" else row // g
            if method == "awq":
                q = (qw[row, col // 8] >> (4 * order.index(col % 8))) & 15
            else:
                q = (qw[row // 8, col] >> (4 * (row % 8))) & 15
            z = ((qz[group, zword] >> (4 * znib)) & 15) + (1 if method == "gptq" else 0)
            w[col, row] = float(q - z) * t["scales"][group, col].float()
    return w


@pytest.mark.parametrize("method,act_order", [("awq", False), ("gptq", False), ("gptq", True)])
def test_awq_gptq_unpack_bit_exact(method, act_order):
    w = torch.randn(16, 256) * 0.1
    t = awq_pack(w, 128) if method == "awq" else gptq_pack(w, 128, act_order)
    if method == "awq":
        ours = awq_weight(t["qweight"], t["qzeros"], t["scales"], 128)
    else:
        ours = gptq_weight(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], 128, 1)
    assert (ours.perm is not None) == act_order
    assert torch.equal(ours.dequantize(), _reference_dequant(t, method, 128))


# --- tiny AWQ / GPTQ checkpoints -----------------------------------------------------------

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _quantized_checkpoint(arch: str, method: str, act_order: bool, out, tokenizer_dir):
    """A tiny random model (inputs of 128 and 256 features: whole groups of 128, also split
    in two) whose linear weights are written in ``method``'s layout, with its config."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen3Config

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                 max_position_embeddings=256, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    config = (LlamaConfig if arch == "llama" else Qwen3Config)(**shape, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {}
    for name, p in model.state_dict().items():
        p = torch.randn_like(p) * 0.15 if "norm" not in name else 1 + torch.randn_like(p) * 0.1
        if name.split(".")[-2] in LINEARS:
            base = name.removesuffix(".weight")
            packed = awq_pack(p, 128) if method == "awq" else gptq_pack(p, 128, act_order,
                                                                       seed=len(tensors))
            tensors.update({f"{base}.{k}": v for k, v in packed.items()})
        else:
            tensors[name] = p.contiguous()
    save_file(tensors, out / "model.safetensors")
    config.architectures = [type(model).__name__]
    config.save_pretrained(out)
    quant = {"quant_method": method, "bits": 4, "group_size": 128}
    quant.update({"version": "gemm", "zero_point": True} if method == "awq"
                 else {"desc_act": act_order, "sym": False})
    data = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**data, "quantization_config": quant}))
    tok.save_pretrained(out)
    return out


def assert_close_greedy(want, got, atol: float = 0.1) -> None:
    """Token-equal, or at the first divergence each side's token in the other's top-5; the
    chosen tokens' logprobs within ``atol`` up to there."""
    for w, g in zip(want, got, strict=True):
        w, g = w.outputs[0], g.outputs[0]
        diverge = next((i for i, (a, b) in enumerate(zip(w.token_ids, g.token_ids)) if a != b),
                       len(w.token_ids))
        if diverge < len(w.token_ids):
            assert w.token_ids[diverge] in g.logprobs[diverge], (diverge, w.token_ids)
            assert g.token_ids[diverge] in w.logprobs[diverge], (diverge, g.token_ids)
        for i in range(diverge):
            a, b = w.logprobs[i][w.token_ids[i]], g.logprobs[i][g.token_ids[i]]
            assert abs(a - b) < atol, (i, a, b)


def _generate(path, **kwargs):
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32, max_num_seqs=4,
              **kwargs)
    try:
        return llm.generate(PROMPTS, GEN, use_tqdm=False), llm.engine.executor.model
    finally:
        llm.close()


@pytest.mark.parametrize("arch,method,act_order", [("llama", "awq", False),
                                                   ("qwen3", "gptq", False),
                                                   ("llama", "gptq", True)])
def test_awq_gptq_checkpoints_kept_quantized_match_dequantized(arch, method, act_order,
                                                                tmp_path, tokenizer_dir):
    path = _quantized_checkpoint(arch, method, act_order, tmp_path, tokenizer_dir)
    kept, model = _generate(path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.packed, Int4Matrix) and not hasattr(qkv, "qweight")
    dense, dense_model = _generate(path, quantization="none")
    assert dense_model.model.layers[0].self_attn.qkv_proj.packed is None
    assert_close_greedy(dense, kept)


def test_awq_shards_across_ranks(tmp_path, tokenizer_dir):
    """Each rank's packed q/k/v, gate/up and o/down hold its slice of the dequantized weight."""
    path = _quantized_checkpoint("llama", "awq", False, tmp_path, tokenizer_dir)
    hf_config, _, _ = load_model_assets(path)
    cfg = ModelConfig.from_hf(hf_config)

    def load(rank, size, option):
        spec = resolve_quant_spec(hf_config.quantization_config, False, option)
        with tensor_parallel_group(rank, size), torch.device("cpu"), quantized_linears(spec):
            model = build_model(cfg, TorchAttentionBackend())
        model.load_weights(iter_weights(path, torch.float32))
        return model.model.layers[1]

    def dense_of(layer, name):  # read back through the kernel: one-hot inputs, exact
        packed = layer.get_submodule(name).packed
        return packed.matmul(torch.eye(packed.in_features)).t()

    whole = load(0, 1, "auto")
    ranks = [load(r, 2, "auto") for r in range(2)]
    for name, dim in (("mlp.down_proj", 1), ("self_attn.o_proj", 1)):
        torch.testing.assert_close(torch.cat([dense_of(r, name) for r in ranks], dim),
                                   dense_of(whole, name), rtol=0, atol=0)
    up = [dense_of(r, "mlp.gate_up_proj") for r in ranks]
    want = dense_of(whole, "mlp.gate_up_proj")
    gate, upper = want.chunk(2)
    torch.testing.assert_close(torch.cat([u.chunk(2)[0] for u in up]), gate, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([u.chunk(2)[1] for u in up]), upper, rtol=0, atol=0)


def test_unsupported_quantization_is_named(tmp_path):
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, vocab_size=100,
                         quantization_config={"quant_method": "bitsandbytes"})
    config.architectures = ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported; supported: awq"):
        ModelConfig.from_hf(config)
    config.quantization_config = {"quant_method": "gptq", "bits": 8, "group_size": 128}
    with pytest.raises(ValueError, match="bits=8 is not supported"):
        ModelConfig.from_hf(config)
    with pytest.raises(ValueError, match="quantization must be one of"):
        LLM(str(tmp_path), quantization="int3")


# --- the real SmolLM2 Q4_1 GGUF ------------------------------------------------------------

def test_smollm2_gguf_kept_quantized_matches_dequantized(smollm2_path):
    kept, model = _generate(smollm2_path)
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.packed, Int4Matrix)
    assert isinstance(layer.mlp.down_proj.packed, Int4Matrix)
    dense, _ = _generate(smollm2_path, quantization="none")
    assert_close_greedy(dense, kept)
    assert "Paris" in kept[0].outputs[0].text


def test_quantized_experts_are_refused():
    from transformers import Qwen3MoeConfig

    config = Qwen3MoeConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=4, vocab_size=100, num_experts=4,
                            quantization_config={"quant_method": "awq", "bits": 4,
                                                 "group_size": 128})
    config.architectures = ["Qwen3MoeForCausalLM"]
    with pytest.raises(ValueError, match="awq.*Qwen3MoeForCausalLM"):
        ModelConfig.from_hf(config)
