"""Writes a Qwen3 benchmark shape as a GGUF file of random bf16 weights with Qwen3's tokenizer.

    python benchmarks/peers/random_gguf.py qwen3-0.6b /tmp/qwen3-0.6b.gguf [--layers 2]

The file is what llama.cpp's converter writes for Qwen3 (architecture "qwen3", its tensor
names, norms in F32, matrices in BF16, key_length/value_length = head_dim, the GPT-2 style BPE
vocabulary padded to the config's vocab_size with [PADn] tokens), so that llama.cpp and
nanoserve load the same weights. The tokenizer comes from .cache/qwen3-tokenizer (fetched by
scripts/fetch_qwen3_tokenizer.sh). Weights: N(0, 0.02) matrices, norms 1, drawn by torch on the
GPU where there is one (seconds for 8B), else on the CPU. BF16 rather than F16: llama.cpp's
CUDA backend multiplies BF16 weights in bf16 through cuBLAS on sm_80+ (mmvf at batch 1), and
nanoserve then runs the weights it runs from a bf16 folder.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from nanoserve.bench.shapes import QWEN3_TOKENIZER_DIR, SHAPES, config_of

STD = 0.02


def tokenizer_fields(tokenizer_dir: Path, vocab_size: int) -> dict:
    """Qwen3's tokenizer as llama.cpp's converter stores it (``_set_vocab_gpt2``)."""
    import gguf
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    cfg_file = tokenizer_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
    T = gguf.TokenType
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [T.UNUSED] * vocab_size
    for text, i in tok["model"]["vocab"].items():
        if i < vocab_size:
            tokens[i], types[i] = text, T.NORMAL
    for added in tok.get("added_tokens", []):
        i = added["id"]
        if i < vocab_size:
            tokens[i] = added["content"]
            types[i] = T.CONTROL if added.get("special") else T.USER_DEFINED
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    ids = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    eos = ids.get(cfg.get("eos_token") or "<|im_end|>", 151645)
    pad = ids.get(cfg.get("pad_token") or "<|endoftext|>", 151643)
    return {"tokens": tokens, "types": types, "merges": merges, "eos": eos, "pad": pad,
            "bos": pad, "chat_template": cfg.get("chat_template")}


def tensor_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """GGUF name -> PyTorch-order shape, as llama.cpp's converter names Qwen3's tensors."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config.get("head_dim") or h // heads
    shapes: dict[str, tuple[int, ...]] = {"token_embd.weight": (config["vocab_size"], h)}
    for i in range(config["num_hidden_layers"]):
        b = f"blk.{i}."
        shapes.update({
            b + "attn_norm.weight": (h,), b + "attn_q.weight": (heads * hd, h),
            b + "attn_k.weight": (kv * hd, h), b + "attn_v.weight": (kv * hd, h),
            b + "attn_output.weight": (h, heads * hd), b + "attn_q_norm.weight": (hd,),
            b + "attn_k_norm.weight": (hd,), b + "ffn_norm.weight": (h,),
            b + "ffn_gate.weight": (inter, h), b + "ffn_up.weight": (inter, h),
            b + "ffn_down.weight": (h, inter)})
    shapes["output_norm.weight"] = (h,)
    if not config.get("tie_word_embeddings"):
        shapes["output.weight"] = (config["vocab_size"], h)
    return shapes


def write_random_gguf(shape: str, path: Path, tokenizer_dir: Path = QWEN3_TOKENIZER_DIR,
                      layers: int | None = None, seed: int = 0, device: str | None = None
                      ) -> Path:
    import gguf
    import torch
    config = config_of(shape, layers)
    if config.get("model_type") != "qwen3":
        raise SystemExit(f"random_gguf.py writes Qwen3 shapes only, not {shape!r} "
                         f"({config.get('model_type')})")
    if not (tokenizer_dir / "tokenizer.json").is_file():
        raise SystemExit(f"no {tokenizer_dir}/tokenizer.json: run scripts/fetch_qwen3_tokenizer.sh")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    hd = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "qwen3")
    w.add_name(f"random {shape}")
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_block_count(config["num_hidden_layers"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_rope_freq_base(float(config["rope_theta"]))
    w.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tok = tokenizer_fields(tokenizer_dir, config["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tok["tokens"])
    w.add_token_types(tok["types"])
    w.add_token_merges(tok["merges"])
    w.add_eos_token_id(tok["eos"])
    w.add_pad_token_id(tok["pad"])
    w.add_bos_token_id(tok["bos"])
    w.add_add_bos_token(False)
    if tok["chat_template"]:
        w.add_chat_template(tok["chat_template"])

    gen = torch.Generator(device=device).manual_seed(seed)
    for name, shp in tensor_shapes(config).items():
        if len(shp) == 1:  # norms: F32 ones, as the converter keeps them
            w.add_tensor(name, np.ones(shp, dtype=np.float32))
            continue
        t = torch.empty(shp, dtype=torch.bfloat16, device=device).normal_(0.0, STD, generator=gen)
        w.add_tensor(name, t.view(torch.int16).cpu().numpy().view(np.uint16),
                     raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(k for k, v in SHAPES.items()
                                                if v.get("model_type") == "qwen3"))
    parser.add_argument("out", type=Path)
    parser.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    parser.add_argument("--tokenizer", type=Path, default=QWEN3_TOKENIZER_DIR)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="where to draw the weights [cuda if any]")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    path = write_random_gguf(args.shape, args.out, args.tokenizer, args.layers, args.seed,
                             args.device)
    print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB in {time.perf_counter() - start:.1f} s",
          file=sys.stderr)


if __name__ == "__main__":
    main()
