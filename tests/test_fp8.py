"""FP8 W8A8 on the CPU reference path: block-scaled (the fp8 method of Qwen3-*-FP8) and
compressed-tensors (per-tensor, per-channel) checkpoints quantized here, and ``quantization=
"fp8"`` on a 32-bit checkpoint, each against the same engine on the dequantized weights (no
activation quantization): greedy equal or within the top-5 rule, logprobs close."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file
from test_quantization import LINEARS, PROMPTS, assert_close_greedy

from nanoserve import LLM, SamplingParams
from nanoserve.layers.quantization.fp8 import FP8, FP8_MAX, Fp8Matrix, quantize_rows

GEN = SamplingParams(temperature=0.0, max_tokens=10, min_tokens=10, logprobs=5)
BLOCK_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                "weight_block_size": [128, 128]}


def _ct_config(strategy: str) -> dict:
    return {"quant_method": "compressed-tensors", "format": "float-quantized",
            "ignore": ["lm_head"], "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy,
                            "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token",
                                      "symmetric": True, "dynamic": True}}}}


def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[N, K]`` as e4m3 with one scale a ``block x block`` tile (``weight_scale_inv``:
    what the codes are multiplied by)."""
    n, k = w.shape
    tiles = w.view(n // block, block, k // block, block)
    scale = tiles.abs().amax((1, 3)) / FP8_MAX
    q = (tiles / scale[:, None, :, None]).to(FP8).view(n, k)
    return q, scale


def _fp8_checkpoint(kind: str, out, tokenizer_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3Config

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = Qwen3Config(hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=256, vocab_size=len(tok),
                         eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {}
    for name, p in model.state_dict().items():
        p = torch.randn_like(p) * 0.15 if "norm" not in name else 1 + torch.randn_like(p) * 0.1
        if name == "lm_head.weight":  # sharper next-token distributions: fewer near ties
            p = p * 4
        elif name.split(".")[-2] in LINEARS:  # the embeddings carry more of the residual
            p = p * 0.5
        tensors[name] = p.contiguous()
        if name.split(".")[-2] not in LINEARS or kind == "dense":
            continue
        if kind == "block":
            tensors[name], tensors[name + "_scale_inv"] = quantize_blocks(p)
        elif kind == "channel":
            tensors[name], tensors[name + "_scale"] = quantize_rows(p)
        else:  # one scale a tensor
            scale = p.abs().amax() / FP8_MAX
            tensors[name], tensors[name + "_scale"] = (p / scale).to(FP8), scale.reshape(1)
    save_file(tensors, out / "model.safetensors")
    config.architectures = ["Qwen3ForCausalLM"]
    config.save_pretrained(out)
    if kind != "dense":
        data = json.loads((out / "config.json").read_text())
        data["quantization_config"] = BLOCK_CONFIG if kind == "block" else _ct_config(kind)
        (out / "config.json").write_text(json.dumps(data))
    tok.save_pretrained(out)
    return out


def _generate(path, **kwargs):
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32, max_num_seqs=4,
              **kwargs)
    try:
        return llm.generate(PROMPTS, GEN, use_tqdm=False), llm.engine.executor.model
    finally:
        llm.close()


def test_block_scales_dequantize_exactly():
    w = torch.randn(256, 384)
    q, scale = quantize_blocks(w)
    want = q.float() * scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    assert torch.equal(Fp8Matrix(q, scale, (128, 128)).dequantize(), want)


@pytest.mark.parametrize("block", [None, (128, 128)])
def test_fp8_matmul_is_both_sides_dequantized(block):
    w = torch.randn(256, 256) * 0.1
    q, scale = quantize_blocks(w) if block else quantize_rows(w)
    x = torch.randn(5, 256)
    xq, sx = quantize_rows(x, 128 if block else 0)
    xd = (xq.double().view(5, -1, 128 if block else 256) * sx.double()[..., None]).view(5, 256)
    matrix = Fp8Matrix(q, scale, block)
    want = xd @ matrix.dequantize().double().t()
    torch.testing.assert_close(matrix.matmul(x).double(), want, rtol=1e-5, atol=1e-4)
    # and close to the unquantized product: e4m3 keeps 3 mantissa bits
    exact = x.double() @ w.double().t()
    assert (matrix.matmul(x).double() - exact).abs().max() < 0.1 * exact.abs().max()


@pytest.mark.parametrize("kind", ["block", "channel", "tensor"])
def test_fp8_checkpoint_matches_dequantized(kind, tmp_path, tokenizer_dir):
    path = _fp8_checkpoint(kind, tmp_path, tokenizer_dir)
    kept, model = _generate(path)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.packed, Fp8Matrix) and qkv.packed.weight.dtype == FP8
    dense, _ = _generate(path, quantization="none")
    assert_close_greedy(dense, kept, atol=1.0)  # activations rounded to e4m3 (2-3%)


def test_online_fp8_matches_the_16_bit_model(tmp_path, tokenizer_dir):
    path = _fp8_checkpoint("dense", tmp_path, tokenizer_dir)
    kept, model = _generate(path, quantization="fp8")
    assert isinstance(model.model.layers[0].mlp.down_proj.packed, Fp8Matrix)
    dense, _ = _generate(path)
    assert_close_greedy(dense, kept, atol=1.0)  # activations rounded to e4m3 (2-3%)
    with pytest.raises(ValueError, match="already quantized"):
        LLM(device="cpu", quantization="fp8")  # the GGUF default model


def test_block_scales_shard_with_their_weights(tmp_path, tokenizer_dir):
    """Each of two ranks' packed q/k/v, gate/up and o/down: its slice of the whole weight."""
    from nanoserve.attention.torch_backend import TorchAttentionBackend
    from nanoserve.config import ModelConfig
    from nanoserve.layers.parallel_state import tensor_parallel_group
    from nanoserve.layers.quantization.methods import quantized_linears
    from nanoserve.layers.quantization.spec import resolve_quant_spec
    from nanoserve.models.loader import iter_weights, load_model_assets
    from nanoserve.models.registry import build_model

    path = _fp8_checkpoint("block", tmp_path, tokenizer_dir)
    hf_config, _, _ = load_model_assets(path)

    def layer(rank, size):
        spec = resolve_quant_spec(hf_config.quantization_config, False, "auto")
        with tensor_parallel_group(rank, size), torch.device("cpu"), quantized_linears(spec):
            model = build_model(ModelConfig.from_hf(hf_config), TorchAttentionBackend())
        model.load_weights(iter_weights(path, torch.float32))
        return model.model.layers[0]

    whole, ranks = layer(0, 1), [layer(r, 2) for r in range(2)]

    def weight(lay, name):
        return lay.get_submodule(name).packed.dequantize()

    for name in ("mlp.down_proj", "self_attn.o_proj"):
        assert torch.equal(torch.cat([weight(r, name) for r in ranks], 1), weight(whole, name))
    halves = [weight(r, "mlp.gate_up_proj").chunk(2) for r in ranks]
    gate, up = weight(whole, "mlp.gate_up_proj").chunk(2)
    assert torch.equal(torch.cat([h[0] for h in halves]), gate)
    assert torch.equal(torch.cat([h[1] for h in halves]), up)
    q = weight(whole, "self_attn.qkv_proj")[:256]  # 4 heads of 64; each rank holds two
    assert torch.equal(torch.cat([weight(r, "self_attn.qkv_proj")[:128] for r in ranks]), q)
