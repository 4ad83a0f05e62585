"""Registers and stack (spills) of the decode split kernel, or with ``--skinny`` of the batch-1
GEMV as each projection of the Qwen3 shapes runs it, compiled for an H200 on any machine.

No GPU needed: Triton compiles for sm_90 and its bundled cuobjdump reports what each program
uses, which sets how many programs an SM can hold (65,536 registers per SM). Use the device's
Triton version (3.6: ``pip install --no-deps --target DIR triton==3.6.0`` and put DIR first on
PYTHONPATH); others allocate differently. One JSON line per variant:

    python benchmarks/kernel_registers.py [--block-n 32 64] [--warps 4 8] [--new-tokens]
        [--wide-offsets] [--splits 32] [--max-registers 96]
    python benchmarks/kernel_registers.py --skinny
    python benchmarks/kernel_registers.py --persistent   (persistent_layers.py's kernel)
    python benchmarks/kernel_registers.py --merged   (the o_proj merging batch-1 splits)
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from common import SHAPES

from nanoserve.kernels.decode_kernels import _decode_split_kernel
from nanoserve.kernels.merged_o_proj import MergedConfig, _merged_o_proj_kernel
from nanoserve.kernels.skinny_gemm import W_LOAD, _skinny_gemm_kernel, default_config

REGISTERS_PER_SM = 65536
SHARED_PER_SM = 228 * 1024  # Hopper; the driver reserves 1 KB of it per resident program
H200 = GPUTarget("cuda", 90, 32)
INT32_POINTERS = {"seq_lens_ptr", "query_start_loc_ptr", "seq_order_ptr", "block_tables_ptr"}
INT64_POINTERS = {"positions_ptr", "slot_ptr"}
# At run time Triton marks 16-byte-aligned pointers and integers divisible by 16 (every stride
# and head count of the Qwen3 shapes) as such, which is what lets it vectorise the K/V loads;
# the block table's stride is exempt (do_not_specialize). Without these the report would
# describe a kernel that never runs.
NOT_SPECIALISED = {"stride_bt", "scale_log2", "eps"}


def arg_type(name: str) -> str:
    """The Triton type of a decode-kernel argument in the engine's bf16 configuration."""
    if name in INT32_POINTERS:
        return "*i32"
    if name in INT64_POINTERS:
        return "*i64"
    if name.startswith("part_"):
        return "*fp32"
    if name.endswith("_ptr"):
        return "*bf16"
    return "fp32" if name in ("scale_log2", "eps") else "i32"


def resource_usage(cubin: bytes) -> dict:
    """Registers and stack frame (where spills go) of a compiled kernel, read from its cubin
    with the cuobjdump that ships with Triton (ptxas -v would do, but Triton's own ptxas may be
    older than the PTX version it emits)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                              text=True, check=True).stdout
    return {"registers": int(re.search(r"REG:(\d+)", text).group(1)),
            "stack_frame": int(re.search(r"STACK:(\d+)", text).group(1))}


def decode_variant(block_n: int, num_warps: int, num_stages: int, new_tokens: bool,
                   narrow_offsets: bool, group: int, head_dim: int, splits: int,
                   max_registers: int | None = None, prefetch_kv: bool = False) -> dict:
    constants = dict(GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 16),
                     HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_SIZE=16, BLOCK_N=block_n,
                     NUM_SPLITS=splits, DOT_PRECISION="tf32", HEADS_FIRST=True, ORDERED=True,
                     PDL=True, NEW_TOKENS=new_tokens, HAS_QK_NORM=new_tokens,
                     NARROW_OFFSETS=narrow_offsets, FP16_PRODUCTS=False,
                     PREFETCH_KV=prefetch_kv and new_tokens)
    names = _decode_split_kernel.arg_names
    signature = {name: "constexpr" if name in constants else arg_type(name) for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if name not in constants and name not in NOT_SPECIALISED}
    kernel = triton.compile(ASTSource(_decode_split_kernel, signature, constants, divisible),
                            target=H200, options=dict(num_warps=num_warps, num_stages=num_stages,
                                                      maxnreg=max_registers))
    usage = resource_usage(kernel.asm["cubin"])
    threads = 32 * num_warps
    return {"kernel": "decode_split", "block_n": block_n, "num_warps": num_warps,
            "num_stages": num_stages, "new_tokens": new_tokens,
            "narrow_offsets": narrow_offsets, "splits": splits, "group": group,
            "head_dim": head_dim, "max_registers": max_registers,
            "prefetch_kv": prefetch_kv and new_tokens, **usage,
            "shared_bytes": kernel.metadata.shared,
            "programs_per_sm_by_registers": REGISTERS_PER_SM // (usage["registers"] * threads),
            "programs_per_sm_by_shared": SHARED_PER_SM // (kernel.metadata.shared + 1024),
            "triton": triton.__version__}


def skinny_variant(n: int, k: int, **flags: bool) -> dict:
    """The batch-1 GEMV for ``n`` x ``k`` with the engine's tiles and the given epilogue flags
    (``RMS``, ``ADD_RESIDUAL``, ``SUM_SQUARES_OUT``, ``ACTIVATE``), in bf16 with a bf16 residual."""
    cfg = default_config(n, k, 1, torch.device("cuda"))
    block_k = min(cfg.block_k, triton.next_power_of_2(k))
    constants = dict(BLOCK_M=1, BLOCK_N=cfg.block_n, BLOCK_K=block_k, HAS_BIAS=False,
                     EVEN_K=k % block_k == 0, PDL=True, DEFER_SUM=cfg.defer_sum,
                     RMS=False, ADD_RESIDUAL=False, SUM_SQUARES_OUT=False, W_CACHE=W_LOAD[0],
                     W_EVICT=W_LOAD[1], ACTIVATE=False)
    constants.update(flags)
    names = _skinny_gemm_kernel.arg_names
    signature = {name: "constexpr" if name in constants
                 else "*fp32" if name == "ss_ptr" else "*bf16" if name.endswith("_ptr")
                 else "fp32" if name == "eps" else "i32" for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if name.endswith("_ptr") or name.startswith("stride") or name in ("N", "K")}
    kernel = triton.compile(ASTSource(_skinny_gemm_kernel, signature, constants, divisible),
                            target=H200, options=dict(num_warps=cfg.num_warps,
                                                      num_stages=cfg.num_stages))
    usage = resource_usage(kernel.asm["cubin"])
    return {"kernel": "skinny_gemm", "n": n, "k": k, "block_n": cfg.block_n, "block_k": block_k,
            "defer_sum": cfg.defer_sum, **{f: True for f, on in flags.items() if on}, **usage,
            "programs_per_sm_by_registers":
                REGISTERS_PER_SM // (usage["registers"] * 32 * cfg.num_warps),
            "triton": triton.__version__}


def merged_variant(shape: str, cfg: MergedConfig, splits: int = 8) -> dict:
    """The o_proj merging batch-1 splits (bf16, the residual epilogue with sums of squares)."""
    c = SHAPES[shape]
    constants = dict(HEADS=c["num_attention_heads"], HEAD_DIM=c["head_dim"], SPLITS=splits,
                     BLOCK_N=cfg.block_n, HEADS_PER_CHUNK=cfg.heads_per_chunk, PDL=True,
                     SUM_SQUARES_OUT=True, W_CACHE=W_LOAD[0], W_EVICT=W_LOAD[1])
    names = _merged_o_proj_kernel.arg_names
    signature = {name: "constexpr" if name in constants
                 else "*fp32" if name in ("part_lse_ptr", "ss_ptr")
                 else "*bf16" if name.endswith("_ptr") else "i32" for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if name not in constants}
    kernel = triton.compile(ASTSource(_merged_o_proj_kernel, signature, constants, divisible),
                            target=H200, options=dict(num_warps=cfg.num_warps, num_stages=1))
    usage = resource_usage(kernel.asm["cubin"])
    return {"kernel": "merged_o_proj", "shape": shape, **cfg._asdict(), "splits": splits,
            **usage, "programs_per_sm_by_registers":
                REGISTERS_PER_SM // (usage["registers"] * 32 * cfg.num_warps),
            "triton": triton.__version__}


def merged_report() -> None:
    """The tilings runs 133-134 measured on the H200, at both shapes."""
    tilings = [MergedConfig(4, 16, 4), MergedConfig(16, 16, 8), MergedConfig(8, 16, 8),
               MergedConfig(8, 16, 4), MergedConfig(16, 16, 4), MergedConfig(32, 8, 8)]
    for shape in ("qwen3-0.6b", "qwen3-8b"):
        for cfg in tilings:
            print(json.dumps(merged_variant(shape, cfg)))


def persistent_variant(shape: str, tiles: dict, num_warps: int) -> dict:
    """persistent_layers.py's kernel for a Qwen3 shape with the given row tiles, bf16."""
    from persistent_layers import _decode_layers_kernel

    c = SHAPES[shape]
    heads, head_dim = c["num_attention_heads"], c["head_dim"]
    constants = dict(
        HIDDEN=c["hidden_size"], INTER=c["intermediate_size"], NUM_HEADS=heads,
        NUM_KV_HEADS=c["num_key_value_heads"], HEAD_DIM=head_dim, BLOCK_SIZE=16,
        ATTN_BLOCK_N=64, BLOCK_G=16, NUM_SPLITS=16,
        BLOCK_HIDDEN=triton.next_power_of_2(c["hidden_size"]),
        BLOCK_Q=triton.next_power_of_2(heads * head_dim),
        BLOCK_INTER=triton.next_power_of_2(c["intermediate_size"]), HAS_QK_NORM=True,
        DOT_PRECISION="tf32", PHASES=31, SYNC=True, SPIN_LIMIT=1 << 20, TIMESTAMPS=False,
        **{f"BLOCK_N_{name}": rows for name, rows in tiles.items()})
    names = _decode_layers_kernel.arg_names
    # Its names arg_type does not know; the rest it types as for the decode kernel.
    types = {"block_table_ptr": "*i32", "seq_len_ptr": "*i32", "sync_ptr": "*i32",
             "position_ptr": "*i64", "stamps_ptr": "*i64", "cache_layer_stride": "i64",
             "qk_eps": "fp32"}
    signature = {name: "constexpr" if name in constants else types.get(name) or arg_type(name)
                 for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if name.endswith("_ptr")}
    kernel = triton.compile(ASTSource(_decode_layers_kernel, signature, constants, divisible),
                            target=H200, options=dict(num_warps=num_warps, num_stages=1))
    return {"kernel": "persistent_layers", "shape": shape, **tiles, "num_warps": num_warps,
            **resource_usage(kernel.asm["cubin"]), "triton": triton.__version__}


def persistent_report() -> None:
    """The tilings benchmarks/decode_layers.py measured (docs/kernels.md)."""
    small = [(dict(QKV=32, O=8, GU=32, DOWN=8), 8), (dict(QKV=16, O=8, GU=32, DOWN=8), 8),
             (dict(QKV=32, O=8, GU=32, DOWN=8), 16), (dict(QKV=32, O=8, GU=64, DOWN=8), 16)]
    for tiles, warps in small:
        print(json.dumps(persistent_variant("qwen3-0.6b", tiles, warps)))
    print(json.dumps(persistent_variant("qwen3-8b", dict(QKV=8, O=4, GU=8, DOWN=2), 8)))


def skinny_report() -> None:
    """Each projection of the Qwen3 shapes plain, then with the epilogue the model gives it."""
    for shape in ("qwen3-0.6b", "qwen3-8b"):
        c = SHAPES[shape]
        hidden, inter = c["hidden_size"], c["intermediate_size"]
        q = c["num_attention_heads"] * c["head_dim"]
        qkv = q + 2 * c["num_key_value_heads"] * c["head_dim"]
        roles = [("qkv", qkv, hidden, dict(RMS=True)), ("o_proj", hidden, q,
                 dict(ADD_RESIDUAL=True, SUM_SQUARES_OUT=True)),
                 ("gate_up", 2 * inter, hidden, dict(RMS=True, ACTIVATE=True)),
                 ("down_proj", hidden, inter, dict(ADD_RESIDUAL=True, SUM_SQUARES_OUT=True))]
        for role, n, k, flags in roles:
            for variant in ({}, flags):
                print(json.dumps({"shape": shape, "role": role, **skinny_variant(n, k, **variant)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--block-n", type=int, nargs="+", default=[16, 32, 64])
    parser.add_argument("--warps", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--stages", type=int, default=3)
    parser.add_argument("--group", type=int, default=2, help="query heads per KV head (0.6B: 2)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--new-tokens", action="store_true",
                        help="the variant that finishes the new tokens (split decode)")
    parser.add_argument("--wide-offsets", action="store_true",
                        help="64-bit K/V offsets (DecodeTuning.narrow_offsets=False, as split "
                             "decode runs); default: the engine's 32-bit ones")
    parser.add_argument("--splits", type=int, default=1, help="NUM_SPLITS (batch 1: 32)")
    parser.add_argument("--prefetch-kv", action="store_true",
                        help="with --new-tokens: the first K/V tile loaded before the wait "
                             "(DecodeTuning.prefetch_kv, as split decode runs)")
    parser.add_argument("--max-registers", type=int,
                        help="cap per thread (DecodeTuning.max_registers, ptx .maxnreg)")
    parser.add_argument("--skinny", action="store_true",
                        help="the batch-1 GEMV of each Qwen3 projection instead")
    parser.add_argument("--persistent", action="store_true",
                        help="the persistent decode-layers experiment instead")
    parser.add_argument("--merged", action="store_true",
                        help="the o_proj that merges batch-1 splits instead")
    args = parser.parse_args()
    if args.merged:
        merged_report()
        return
    if args.skinny:
        skinny_report()
        return
    if args.persistent:
        persistent_report()
        return
    for block_n in args.block_n:
        for warps in args.warps:
            print(json.dumps(decode_variant(block_n, warps, args.stages, args.new_tokens,
                                            not args.wide_offsets, args.group, args.head_dim,
                                            args.splits, args.max_registers,
                                            args.prefetch_kv)))


if __name__ == "__main__":
    main()
