"""Registers and stack (spills) of the decode split kernel, compiled for an H200 on any machine.

No GPU needed: Triton compiles for sm_90 and its bundled cuobjdump reports what each program
uses, which sets how many programs an SM can hold (65,536 registers per SM). Use the device's
Triton version (3.6: ``pip install --no-deps --target DIR triton==3.6.0`` and put DIR first on
PYTHONPATH); others allocate differently. One JSON line per variant:

    python benchmarks/kernel_registers.py [--block-n 32 64] [--warps 4 8] [--new-tokens]
        [--wide-offsets] [--splits 32]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nanoserve.kernels.decode_kernels import _decode_split_kernel

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
                   narrow_offsets: bool, group: int, head_dim: int, splits: int) -> dict:
    constants = dict(GROUP=group, BLOCK_G=max(triton.next_power_of_2(group), 16),
                     HEAD_DIM=head_dim, BLOCK_D=head_dim, BLOCK_SIZE=16, BLOCK_N=block_n,
                     NUM_SPLITS=splits, DOT_PRECISION="tf32", HEADS_FIRST=True, ORDERED=True,
                     PDL=True, NEW_TOKENS=new_tokens, HAS_QK_NORM=new_tokens,
                     NARROW_OFFSETS=narrow_offsets)
    names = _decode_split_kernel.arg_names
    signature = {name: "constexpr" if name in constants else arg_type(name) for name in names}
    divisible = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
                 if name not in constants and name not in NOT_SPECIALISED}
    kernel = triton.compile(ASTSource(_decode_split_kernel, signature, constants, divisible),
                            target=H200, options=dict(num_warps=num_warps, num_stages=num_stages))
    usage = resource_usage(kernel.asm["cubin"])
    threads = 32 * num_warps
    return {"kernel": "decode_split", "block_n": block_n, "num_warps": num_warps,
            "num_stages": num_stages, "new_tokens": new_tokens,
            "narrow_offsets": narrow_offsets, "splits": splits, "group": group,
            "head_dim": head_dim, **usage, "shared_bytes": kernel.metadata.shared,
            "programs_per_sm_by_registers": REGISTERS_PER_SM // (usage["registers"] * threads),
            "programs_per_sm_by_shared": SHARED_PER_SM // (kernel.metadata.shared + 1024),
            "triton": triton.__version__}


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
    args = parser.parse_args()
    for block_n in args.block_n:
        for warps in args.warps:
            print(json.dumps(decode_variant(block_n, warps, args.stages, args.new_tokens,
                                            not args.wide_offsets, args.group, args.head_dim,
                                            args.splits)))


if __name__ == "__main__":
    main()
