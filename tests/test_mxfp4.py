"""MXFP4 (GPT-OSS's published expert format): blocks and scales dequantize exactly as the format
defines them and as transformers does; a GPT-OSS checkpoint whose experts are MXFP4 loads and
gives transformers' greedy tokens (transformers dequantizing the same file), fp32 on the CPU."""
from __future__ import annotations

import json

import pytest
import torch
from reference import PROMPTS, hf_greedy
from safetensors.torch import load_file, save_file
from test_model_breadth import NEW_TOKENS, generate, save_random
from transformers import AutoModelForCausalLM, AutoTokenizer, GptOssConfig, Mxfp4Config

from nanoserve import LLM
from nanoserve.layers.quantization.mxfp4 import dequantize_mxfp4


def test_dequantize_follows_the_format_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(100, 150, (3, 10, 4), dtype=torch.uint8, generator=gen)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (3, 10, 128)
    # The format: value j of a block is e2m1 code j (even j: low nibble) times 2^(scale - 127).
    e, r, g, j = 2, 7, 3, 21
    code = int(blocks[e, r, g, j // 2]) >> (4 * (j % 2)) & 15
    magnitude = [0, 0.5, 1, 1.5, 2, 3, 4, 6][code & 7] * 2.0 ** (int(scales[e, r, g]) - 127)
    assert got[e, r, 32 * g + j].item() == (-magnitude if code & 8 else magnitude)
    assert torch.equal(got.transpose(1, 2), convert_moe_packed_tensors(
        blocks, scales, dtype=torch.float32))
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks[..., :8], scales)


def _mxfp4_checkpoint(path, gen: torch.Generator) -> None:
    """Replace the experts' float weights in ``path`` by random MXFP4 blocks and scales (HF's
    layout: ``[E, out, in / 32, 16]`` and ``[E, out, in / 32]``)."""
    file = next(path.glob("*.safetensors"))
    tensors = load_file(file)
    for name in [n for n in tensors if n.endswith((".experts.gate_up_proj",
                                                   ".experts.down_proj"))]:
        experts, k, n = tensors.pop(name).shape  # HF holds them [E, in, out]
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16),
                                                  dtype=torch.uint8, generator=gen)
        tensors[f"{name}_scales"] = torch.randint(122, 125, (experts, n, k // 32),
                                                  dtype=torch.uint8, generator=gen)
    save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4", "modules_to_not_convert": [
            "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))


def test_gpt_oss_mxfp4_checkpoint_matches_transformers(tmp_path, tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = GptOssConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_local_experts=4, num_experts_per_tok=2, sliding_window=6,
                          max_position_embeddings=512, vocab_size=len(tok),
                          eos_token_id=tok.eos_token_id, tie_word_embeddings=False)
    path = save_random(config, tmp_path, tokenizer_dir)
    _mxfp4_checkpoint(path, torch.Generator().manual_seed(1))
    # Dequantized by transformers itself: without it, newer versions fetch Hub kernels.
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True))
    stored = load_file(next(path.glob("*.safetensors")))
    prefix = "model.layers.1.mlp.experts.down_proj"  # transformers read the blocks: the same
    assert torch.equal(model.model.layers[1].mlp.experts.down_proj.float(), dequantize_mxfp4(
        stored[f"{prefix}_blocks"], stored[f"{prefix}_scales"]).transpose(1, 2))
    ids = [tok.encode(p) for p in PROMPTS]
    want = hf_greedy(model, ids, NEW_TOKENS)
    llm = LLM(str(path), device="cpu", dtype="float32")
    try:
        assert generate(llm, ids) == want
    finally:
        llm.close()


def test_a_half_without_the_other_is_refused():
    from nanoserve.models.loader import CheckpointTensor
    from nanoserve.models.weight_map import mxfp4_tensors

    blocks = torch.zeros(2, 4, 1, 16, dtype=torch.uint8)
    lone = CheckpointTensor("m.experts.down_proj_blocks", blocks.shape, None,
                            lambda index: blocks[index])
    with pytest.raises(ValueError, match="without their other half"):
        list(mxfp4_tensors([("m.experts.down_proj_blocks", lone)]))
