"""GGUF files of Qwen3, Qwen3-MoE, Phi-3, Gemma-2/3 and Mistral: tiny random models written as
llama.cpp's converter writes them; nanoserve's weights against transformers' GGUF loader and
its greedy tokens against the same model loaded from a Hugging Face folder."""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from conftest import TINY_COMMON
from test_gguf import _write_tiny_gguf
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    Phi3Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from nanoserve import LLM, SamplingParams
from nanoserve.config import ModelConfig
from nanoserve.models.gguf import iter_gguf_weights, load_gguf_config
from nanoserve.models.loader import load_hf_config

Q = gguf.GGMLQuantizationType
# GGUF architecture and gguf-py's model enum (its tensor names) of each Hugging Face model type.
ARCHS = {"qwen3": ("qwen3", "QWEN3"), "qwen3_moe": ("qwen3moe", "QWEN3MOE"),
         "phi3": ("phi3", "PHI3"),
         "gemma2": ("gemma2", "GEMMA2"), "gemma3_text": ("gemma3", "GEMMA3"),
         "mistral": ("llama", "LLAMA")}
EXPERTS = {"gate": "ffn_gate_exps", "up": "ffn_up_exps", "down": "ffn_down_exps"}


def _config(arch: str, vocab_size: int, eos_id: int) -> Any:
    # An epsilon float32 holds exactly, as GGUF stores it.
    common = dict(TINY_COMMON, vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=None,
                  rms_norm_eps=2.0 ** -20)
    if arch == "qwen3":  # head_dim 32 != hidden / heads (16), as Qwen3-0.6B's 128 != 64; not
        # transformers' Qwen3 default (128) either: only the file's key_length says it
        return Qwen3Config(**common, head_dim=32, rope_theta=1e6, tie_word_embeddings=True)
    if arch == "qwen3moe":  # llama.cpp always renormalises the top-k weights
        return Qwen3MoeConfig(**common, head_dim=32, rope_theta=1e6, num_experts=4,
                              num_experts_per_tok=2, moe_intermediate_size=64,
                              norm_topk_prob=True, tie_word_embeddings=False)
    if arch == "phi3":  # half of each head rotated, as in Phi-4-mini
        return Phi3Config(**common, rope_theta=10000.0, tie_word_embeddings=False,
                          partial_rotary_factor=0.5, sliding_window=4)
    if arch in ("gemma2", "gemma3"):  # llama.cpp scales queries by head_dim ** -0.5
        cls = Gemma2Config if arch == "gemma2" else Gemma3TextConfig
        config = cls(**common, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                     tie_word_embeddings=True)
        if arch == "gemma3":  # not the default local RoPE base: read from the file
            config.rope_parameters["sliding_attention"]["rope_theta"] = 50000.0
        return config
    return MistralConfig(**common, head_dim=16, sliding_window=None, tie_word_embeddings=False)


def _llama_cpp_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter's q/k row order for llama: per head, rotary halves interleaved."""
    return (w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_tensors(model: Any, gguf_arch: str, enum: str) -> dict[str, torch.Tensor]:
    """The model's tensors under the names and in the form llama.cpp's converter writes."""
    cfg = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[enum], cfg.num_hidden_layers)
    out = {}
    for hf_name, w in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if ".mlp.experts." in hf_name:  # [E, 2I, H] gate|up and [E, H, I]: stacked per part
            prefix = f"blk.{hf_name.split('.')[2]}."
            parts = (w.chunk(2, dim=1) if hf_name.endswith("gate_up_proj") else (w,))
            for part, t in zip(("gate", "up") if len(parts) == 2 else ("down",), parts):
                out[prefix + EXPERTS[part] + ".weight"] = t
            continue
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base) + "." + suffix
        if gguf_arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = cfg.num_attention_heads if "attn_q" in name else cfg.num_key_value_heads
            w = _llama_cpp_permute(w, heads)
        if gguf_arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1  # Gemma's norms scale by (1 + w): llama.cpp stores the factor
        out[name] = w
    return out


def _add_metadata(writer: gguf.GGUFWriter, cfg: Any, arch: str) -> None:
    """The hyperparameters as llama.cpp's converter writes them for each architecture."""
    writer.add_name({"llama": "Mistral", "qwen3moe": "Qwen3Moe"}.get(arch, arch.capitalize()))
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        writer.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        writer.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    elif arch != "gemma2":  # the converter writes no Gemma-2 RoPE base: llama.cpp's default
        writer.add_rope_freq_base(rope["rope_theta"])
    if arch != "phi3":
        writer.add_key_length(cfg.head_dim)
        writer.add_value_length(cfg.head_dim)
    if arch == "qwen3moe":
        writer.add_expert_count(cfg.num_experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        rotated = rope.get("partial_rotary_factor", 1.0) * cfg.hidden_size
        writer.add_rope_dimension_count(int(rotated) // cfg.num_attention_heads)
        writer.add_sliding_window(cfg.sliding_window or 0)
    if arch == "llama":
        writer.add_vocab_size(cfg.vocab_size)
        writer.add_rope_dimension_count(cfg.head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_add_space_prefix(False)


def _stored(name: str, w: torch.Tensor, qtype: Q) -> tuple[np.ndarray, Q]:
    """The converter's choice: norms, biases and routers stay F32, matrices take ``qtype``."""
    array = w.detach().float().numpy()
    if qtype == Q.F32 or array.ndim == 1 or "ffn_gate_inp" in name:
        return array, Q.F32
    if qtype == Q.F16:
        return array.astype(np.float16), Q.F16
    return gguf.quants.quantize(array, qtype), qtype


def _add_tokenizer(writer: gguf.GGUFWriter, tokenizer: dict[str, Any]) -> None:
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(tokenizer["pre"])
    writer.add_token_list(tokenizer["tokens"])
    writer.add_token_types(tokenizer["token_type"])
    writer.add_token_merges(tokenizer["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("unknown", writer.add_unk_token_id), ("padding", writer.add_pad_token_id)):
        add(tokenizer[key])
    writer.add_chat_template(tokenizer["chat_template"])


def write_gguf(model: Any, path: Path, tokenizer: dict[str, Any], qtype: Q) -> Path:
    gguf_arch, enum = ARCHS[model.config.model_type]
    writer = gguf.GGUFWriter(path, gguf_arch)
    _add_metadata(writer, model.config, gguf_arch)
    writer.add_file_type({Q.F32: 0, Q.F16: 1, Q.Q8_0: 7}[qtype])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, tokenizer)
    for name, w in _gguf_tensors(model, gguf_arch, enum).items():
        array, kind = _stored(name, w, qtype)
        writer.add_tensor(name, array, raw_dtype=None if kind in (Q.F32, Q.F16) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


VOCAB = 1024  # SmolLM2's first tokens (its special ones among them): files parse fast


@pytest.fixture(scope="module")
def tokenizer_fields(smollm2_path) -> dict[str, Any]:
    """SmolLM2's tokenizer as its GGUF stores it, cut to its first ``VOCAB`` tokens and the
    merges among them."""
    reader = gguf.GGUFReader(smollm2_path)
    fields = {key: reader.fields[f"tokenizer.ggml.{key}"].contents()
              for key in ("pre", "tokens", "token_type", "merges")}
    fields["tokens"], fields["token_type"] = fields["tokens"][:VOCAB], fields["token_type"][:VOCAB]
    kept = set(fields["tokens"])
    fields["merges"] = [m for m in fields["merges"]
                        if m.replace(" ", "") in kept and set(m.split(" ")) <= kept]
    for key in ("bos", "eos", "unknown", "padding"):
        fields[key] = reader.fields[f"tokenizer.ggml.{key}_token_id"].contents()
    fields["chat_template"] = reader.fields["tokenizer.chat_template"].contents()
    return fields


@pytest.fixture(scope="module")
def tokenizer_folder(tokenizer_fields, tmp_path_factory) -> Path:
    """The same tokenizer as a Hugging Face folder, read by transformers from a llama GGUF
    (from a Gemma one it would take the GPT-2 vocabulary for SentencePiece)."""
    from transformers import AutoTokenizer
    out = tmp_path_factory.mktemp("gguf-tokenizer")
    writer = gguf.GGUFWriter(out / "tok.gguf", "llama")
    _add_tokenizer(writer, tokenizer_fields)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    AutoTokenizer.from_pretrained(out, gguf_file="tok.gguf").save_pretrained(out)
    return out


def _random_model(arch: str, eos_id: int) -> Any:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config(arch, VOCAB, eos_id), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():  # wider than the init: less flat logits
            p.normal_(0.0, 0.15)
            if "norm" in name and "gemma" not in arch:  # Gemma's norms scale by (1 + w)
                p.add_(1.0)
    return model


def _transformers_tensors(path: Path) -> dict[str, torch.Tensor]:
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    with torch.device("meta"):
        shell = AutoModelForCausalLM.from_config(load_gguf_config(path))
    return load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=shell)["tensors"]


def _ours_stacked(path: Path) -> dict[str, torch.Tensor]:
    """nanoserve's per-expert tensors stacked as transformers' fused experts are."""
    ours: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, w in iter_gguf_weights(path):
        if ".mlp.experts." not in name:
            ours[name] = w
            continue
        prefix, index, part = name.rsplit(".", 3)[0], int(name.split(".")[5]), name.split(".")[6]
        experts.setdefault(prefix, {}).setdefault(index, {})[part] = w
    for prefix, by_index in experts.items():
        rows = [by_index[i] for i in range(len(by_index))]
        ours[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([r["gate_proj"], r["up_proj"]]) for r in rows])
        ours[prefix + ".down_proj"] = torch.stack([r["down_proj"] for r in rows])
    return ours


def _greedy(path: Path, quantization: str) -> list[tuple[list[int], list[int]]]:
    llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32,
              quantization=quantization)
    try:
        prompts = ["The capital of France is", "def add(a, b): return a + b"]
        outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8),
                            use_tqdm=False)
        return [(o.prompt_token_ids, o.outputs[0].token_ids) for o in outs]
    finally:
        llm.close()


CASES = [("qwen3", Q.F32), ("qwen3", Q.F16), ("qwen3moe", Q.F32), ("phi3", Q.F32),
         ("gemma2", Q.F32), ("gemma3", Q.F32),
         ("mistral", Q.F32), ("gemma3", Q.F16), ("qwen3moe", Q.Q8_0)]


@pytest.mark.parametrize(("arch", "qtype"), CASES, ids=[f"{a}-{q.name}" for a, q in CASES])
def test_gguf_matches_transformers_and_hf_folder(arch, qtype, tokenizer_fields, tokenizer_folder,
                                                 tmp_path):
    from transformers import AutoTokenizer
    model = _random_model(arch, tokenizer_fields["eos"])
    path = write_gguf(model, tmp_path / f"{arch}.gguf", tokenizer_fields, qtype)

    ours, theirs = _ours_stacked(path), _transformers_tensors(path)
    assert set(ours) == set(theirs)
    for name, w in ours.items():
        torch.testing.assert_close(w, theirs[name].float(), rtol=0, atol=0, msg=name)
    if qtype == Q.F32:  # the converter's changes (permuted q/k, Gemma's w + 1) undone
        expected = {k: v for k, v in model.state_dict().items()
                    if k != "lm_head.weight" or not model.config.tie_word_embeddings}
        assert set(ours) == set(expected)
        for name, w in ours.items():
            torch.testing.assert_close(w, expected[name], rtol=0, atol=1e-6, msg=name)
    else:  # the reference model holds the dequantized weights
        missing, unexpected = model.load_state_dict(theirs, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}

    folder = tmp_path / "hf"
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_folder).save_pretrained(folder)
    # The engine's view of the model: every field the same (Mistral's file says "llama").
    ours_cfg, want_cfg = (asdict(ModelConfig.from_hf(load_hf_config(p))) for p in (path, folder))
    differ = {k: v for k, v in ours_cfg.items() if want_cfg[k] != v}
    assert differ == ({"architecture": "LlamaForCausalLM"} if arch == "mistral" else {})
    # quantization="none": the GGUF blocks dequantized at load, the same weights as the folder.
    assert _greedy(path, "none") == _greedy(folder, "none")


def test_qwen3_head_dim_from_key_length_greedy_as_transformers(tokenizer_fields, tmp_path):
    """A Qwen3 GGUF whose head size (key_length 32) is neither hidden / heads (16) nor
    transformers' Qwen3 default (128): loaded with it, greedy tokens as transformers' model."""
    model = _random_model("qwen3", tokenizer_fields["eos"])
    path = write_gguf(model, tmp_path / "qwen3.gguf", tokenizer_fields, Q.F32)
    assert load_gguf_config(path).head_dim == 32
    model.generation_config.eos_token_id = None  # fixed lengths on both sides
    for prompt_ids, ours in _greedy(path, "none"):
        ids = torch.tensor([prompt_ids])
        with torch.no_grad():
            theirs = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                    max_new_tokens=len(ours), pad_token_id=0)
        assert theirs[0, len(prompt_ids):].tolist() == ours


@pytest.mark.parametrize("arch", ["qwen2moe", "falcon", "gpt2"])  # transformers reads these
def test_unsupported_architecture_lists_supported(arch, tmp_path):
    path = _write_tiny_gguf(tmp_path / f"{arch}.gguf", arch,
                            {"token_embd.weight": np.zeros((4, 4), np.float32)})
    supported = "gemma2, gemma3, llama, phi3, qwen2, qwen3, qwen3moe"
    message = f"unsupported GGUF architecture '{arch}' \\(supported: {supported}\\)"
    with pytest.raises(ValueError, match=message):
        load_gguf_config(path)
    with pytest.raises(ValueError, match=message):
        list(iter_gguf_weights(path))
    with pytest.raises(ValueError, match=message):
        LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=8)


def test_phi3_longrope_factors_refused(tmp_path):
    path = _write_tiny_gguf(tmp_path / "phi3.gguf", "phi3", {
        "token_embd.weight": np.zeros((4, 4), np.float32),
        "rope_factors_long.weight": np.ones(2, np.float32)})
    with pytest.raises(ValueError, match="'rope_factors_long.weight' is not supported: Phi-3"):
        list(iter_gguf_weights(path))


def test_quantized_experts_dequantized_with_a_log_line(tokenizer_fields, tmp_path, caplog):
    model = _random_model("qwen3moe", tokenizer_fields["eos"])
    path = write_gguf(model, tmp_path / "moe.gguf", tokenizer_fields, Q.Q8_0)
    with caplog.at_level("INFO", logger="nanoserve.models.gguf"):
        weights = dict(iter_gguf_weights(path))
    assert "expert tensors (Q8_0) are dequantized at load" in caplog.text
    stacked = gguf.quants.dequantize(
        next(t for t in gguf.GGUFReader(path).tensors
             if t.name == "blk.0.ffn_down_exps.weight").data, Q.Q8_0)
    for expert in range(model.config.num_experts):  # each read alone, the same values
        assert torch.equal(weights[f"model.layers.0.mlp.experts.{expert}.down_proj.weight"],
                           torch.from_numpy(stacked[expert]))


@pytest.mark.parametrize("arch", ["phi3", "qwen3moe"])
def test_q8_0_kept_packed_matches_dequantized(arch, tokenizer_fields, tmp_path):
    """Phi-3's fused qkv and gate|up blocks split by rows and kept packed; Qwen3-MoE's
    attention packed, its experts dequantized: close to the all-dequantized model."""
    from test_quantization import assert_close_greedy
    model = _random_model(arch, tokenizer_fields["eos"])
    path = write_gguf(model, tmp_path / f"{arch}.gguf", tokenizer_fields, Q.Q8_0)
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5)
    runs = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), device="cpu", dtype="float32", num_kv_blocks=32,
                  quantization=quantization)
        try:
            runs[quantization] = llm.generate(["The capital of France is"], params,
                                              use_tqdm=False)
            qkv = llm.engine.executor.model.model.layers[0].self_attn.qkv_proj
            assert (qkv.packed is None) == (quantization == "none")
        finally:
            llm.close()
    assert_close_greedy(runs["none"], runs["auto"])


@pytest.mark.parametrize(("fields", "sliding"), [
    ({}, [False] * 7),  # no window: llama.cpp makes every layer full
    ({"gemma3.attention.sliding_window": 8}, None),  # transformers' default: every 6th full
    ({"gemma3.attention.sliding_window": 8, "gemma3.attention.sliding_window_pattern": 3},
     [True, True, False, True, True, False, True]),
    ({"gemma3.attention.sliding_window": 8,
      "gemma3.attention.sliding_window_pattern": np.array([1, 0, 0, 1, 1, 1, 0], bool)},
     [True, False, False, True, True, True, False])])
def test_gemma3_layer_kinds_as_llama_cpp_reads_them(fields, sliding):
    from nanoserve.models.gguf_names import fill_config
    config = Gemma3TextConfig(num_hidden_layers=7, head_dim=16)
    default = list(config.layer_types)
    fill_config(config, "gemma3", fields)
    want = default if sliding is None else ["sliding_attention" if s else "full_attention"
                                            for s in sliding]
    assert config.layer_types == want
    assert default == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"]


def test_tokenizer_not_cached_where_it_reloads_differently(tokenizer_fields, tmp_path,
                                                            monkeypatch, caplog):
    """transformers saves a Gemma file's GPT-2 vocabulary in a form it reloads differently:
    the asset cache keeps no copy, so every start tokenizes as the file does."""
    monkeypatch.setenv("NANOSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(_random_model("gemma3", tokenizer_fields["eos"]),
                      tmp_path / "gemma3.gguf", tokenizer_fields, Q.F32)
    with caplog.at_level("WARNING", logger="nanoserve.models.asset_cache"):
        first, second = _greedy(path, "none"), _greedy(path, "none")
    assert "not caching gemma3.gguf's config and tokenizer" in caplog.text
    assert first == second and 0 not in first[0][0]  # no unknown tokens in the prompt
