"""GGUF loading: weights against transformers' own GGUF loader, config, tokenizer, errors."""
from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from nanoserve.models.gguf import (
    is_gguf,
    iter_gguf_weights,
    load_gguf_config,
    load_gguf_eos_token_ids,
    load_gguf_tokenizer,
)


@pytest.fixture(scope="module")
def smollm2_config(smollm2_path):
    return load_gguf_config(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_path):
    return load_gguf_tokenizer(smollm2_path)


@pytest.fixture(scope="module")
def smollm2_weights(smollm2_path) -> dict[str, torch.Tensor]:
    return dict(iter_gguf_weights(smollm2_path))


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The row order llama.cpp's converter gives q/k: per head, rotary halves interleaved."""
    half = w.shape[0] // n_heads // 2
    return w.reshape(n_heads, 2, half, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, arch: str, tensors: dict[str, np.ndarray],
                     n_heads: int = 2, n_kv_heads: int = 1) -> Path:
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv_heads)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_weights_match_transformers(smollm2_path, smollm2_config, smollm2_weights):
    # from_pretrained(..., gguf_file=...) insists on accelerate, which nanoserve does not
    # need; load_gguf_checkpoint is the dequantize-and-unpermute step it runs underneath.
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(smollm2_config)
    expected = load_gguf_checkpoint(str(smollm2_path), return_tensors=True,
                                    model_to_load=model)["tensors"]

    assert set(smollm2_weights) == set(expected)
    # Every model parameter is covered, lm_head only through the tied embeddings.
    assert set(model.state_dict()) - set(smollm2_weights) == {"lm_head.weight"}
    assert smollm2_config.tie_word_embeddings
    for name, ours in smollm2_weights.items():
        theirs = expected[name].to(torch.float32)
        assert ours.dtype == torch.float32 and ours.shape == theirs.shape, name
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=name)
    assert smollm2_weights["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert smollm2_weights["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert smollm2_weights["model.embed_tokens.weight"].shape == (49152, 576)


def test_unpermuted_qk_give_lower_loss(smollm2_config, smollm2_weights, smollm2_tokenizer):
    """Independent of transformers' loader: the unpermuted q/k give a far better LM loss."""
    from transformers import AutoModelForCausalLM

    text = ("The capital of France is Paris. The capital of Germany is Berlin. "
            "The capital of Italy is Rome.")
    ids = torch.tensor([smollm2_tokenizer.encode(text)])
    model = AutoModelForCausalLM.from_config(smollm2_config, dtype=torch.float32)

    def loss_with(weights: dict[str, torch.Tensor]) -> float:
        model.load_state_dict(weights, strict=False)
        model.tie_weights()
        with torch.no_grad():
            return model(ids, labels=ids).loss.item()

    heads = {"q_proj": smollm2_config.num_attention_heads,
             "k_proj": smollm2_config.num_key_value_heads}
    still_permuted = {
        name: torch.from_numpy(_llama_cpp_permute(w.numpy(), heads[name.split(".")[-2]]))
        if name.split(".")[-2] in heads else w
        for name, w in smollm2_weights.items()}
    good, bad = loss_with(smollm2_weights), loss_with(still_permuted)
    assert good < 3.0 and bad > good + 1.0, (good, bad)


def test_dtype_conversion(smollm2_path):
    name, weight = next(iter(iter_gguf_weights(smollm2_path, dtype=torch.bfloat16)))
    assert name == "model.embed_tokens.weight" and weight.dtype == torch.bfloat16


def test_config(smollm2_config):
    c = smollm2_config
    assert c.model_type == "llama"
    assert (c.num_attention_heads, c.num_key_value_heads, c.num_hidden_layers) == (9, 3, 30)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.tie_word_embeddings is True
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}
    assert rope["rope_theta"] == pytest.approx(100000.0)
    assert c.rms_norm_eps == pytest.approx(1e-5)


def test_tokenizer(smollm2_tokenizer):
    tok = smollm2_tokenizer
    text = "Hello, world! Ünïcödé and  spaces\nnew line 1234."
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    assert tok.chat_template
    prompt = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                     add_generation_prompt=True)
    assert "<|im_start|>user\nHi<|im_end|>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


def test_eos_ids(smollm2_path):
    assert load_gguf_eos_token_ids(smollm2_path) == [2]


def test_is_gguf(tmp_path, smollm2_path):
    assert is_gguf(smollm2_path) and is_gguf(smollm2_path.parent)
    assert is_gguf(tmp_path / "missing.gguf")  # so that loading it reports the missing file
    assert not is_gguf(tmp_path / "missing")
    assert not is_gguf(tmp_path)  # empty folder
    (tmp_path / "m.gguf").write_bytes(b"")
    assert is_gguf(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert not is_gguf(tmp_path)  # a Hugging Face checkpoint that also carries a GGUF


def test_folder_with_several_ggufs(tmp_path):
    (tmp_path / "a.gguf").write_bytes(b"")
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(ValueError, match="exactly one .gguf"):
        load_gguf_config(tmp_path)


@pytest.mark.parametrize("load", [load_gguf_config, load_gguf_tokenizer, load_gguf_eos_token_ids,
                                  lambda p: next(iter_gguf_weights(p))])
def test_missing_file(tmp_path, load):
    path = tmp_path / "nothere.gguf"
    with pytest.raises(FileNotFoundError, match=str(path)):
        load(path)


@pytest.mark.parametrize("content", [b"not a gguf file at all", b"GGUF\x03\x00\x00\x00garbage"])
@pytest.mark.parametrize("load", [load_gguf_config, load_gguf_tokenizer, load_gguf_eos_token_ids,
                                  lambda p: next(iter_gguf_weights(p))])
def test_corrupt_file(tmp_path, content, load):
    path = tmp_path / "corrupt.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match=str(path)):
        load(path)


def test_llama_permutation_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2 * 8, 16), dtype=np.float32)  # 2 heads of dim 8, hidden 16
    k = rng.standard_normal((1 * 8, 16), dtype=np.float32)  # 1 kv head
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "llama", {
        "blk.0.attn_q.weight": _llama_cpp_permute(q, 2),
        "blk.0.attn_k.weight": _llama_cpp_permute(k, 1),
        "output.weight": q,
    })
    weights = dict(iter_gguf_weights(path))
    assert torch.equal(weights["model.layers.0.self_attn.q_proj.weight"], torch.from_numpy(q))
    assert torch.equal(weights["model.layers.0.self_attn.k_proj.weight"], torch.from_numpy(k))
    assert torch.equal(weights["lm_head.weight"], torch.from_numpy(q))


def test_qwen3_names_not_permuted(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal(shape, dtype=np.float32) for name, shape in {
        "blk.0.attn_q.weight": (16, 16), "blk.0.attn_k.weight": (8, 16),
        "blk.0.attn_q_norm.weight": (8,), "blk.0.attn_k_norm.weight": (8,)}.items()}
    path = _write_tiny_gguf(tmp_path / "tiny.gguf", "qwen3", tensors)
    weights = dict(iter_gguf_weights(path))
    prefix = "model.layers.0.self_attn."
    assert set(weights) == {prefix + n for n in ("q_proj.weight", "k_proj.weight",
                                                 "q_norm.weight", "k_norm.weight")}
    assert torch.equal(weights[prefix + "q_proj.weight"],
                       torch.from_numpy(tensors["blk.0.attn_q.weight"]))
    assert torch.equal(weights[prefix + "q_norm.weight"],
                       torch.from_numpy(tensors["blk.0.attn_q_norm.weight"]))


def test_unknown_tensor_and_architecture(tmp_path):
    tiny = np.zeros((4, 4), dtype=np.float32)
    path = _write_tiny_gguf(tmp_path / "odd.gguf", "llama", {"blk.0.attn_qkv.weight": tiny})
    with pytest.raises(ValueError, match="unknown tensor 'blk.0.attn_qkv.weight'"):
        list(iter_gguf_weights(path))
    path = _write_tiny_gguf(tmp_path / "gpt2.gguf", "gpt2", {"token_embd.weight": tiny})
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        list(iter_gguf_weights(path))
