"""Every shipped tuning file belongs to a tunable op and holds only entries its op's select can
read: a stale field would otherwise fail the first launch of its shape, mid-run."""
import json
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import (decode_attention, fp8_block_gemm, fused_moe,  # noqa: E402
                               fused_ops, int4_gemm, int4_gemv, mla_decode,
                               prefill_attention, qk_norm_rope, sampling, skinny_gemm, tuning)
from nanoserve.kernels.tune import OPS  # noqa: E402

# Each op's config type, and the one string an entry may be instead (another kernel wins).
CONFIGS = {"skinny_gemm": (skinny_gemm.SkinnyConfig, skinny_gemm.CUBLAS),
           "int4_gemv": (int4_gemv.Int4GemvConfig, int4_gemm.TENSOR_CORE),
           "decode_attention": (decode_attention.DecodeTuning, None),
           "prefill_attention": (prefill_attention.PrefillConfig, None),
           "fused_moe": (fused_moe.MoeTiles, None),
           "rms_norm": (fused_ops.RmsNormConfig, None),
           "silu_and_mul": (fused_ops.SiluAndMulConfig, None),
           "qk_norm_rope": (qk_norm_rope.QkNormRopeConfig, None),
           "sampling": (sampling.SamplingConfig, None),
           "mla_decode": (mla_decode.MlaDecodeConfig, None),
           "int4_gemm": (int4_gemm.Int4GemmConfig, None),
           "fp8_block_gemm": (fp8_block_gemm.Fp8BlockConfig, None)}


def test_every_tunable_op_has_a_config_type():
    assert set(OPS) | {"int4_gemv"} <= set(CONFIGS)


@pytest.mark.parametrize("path", sorted(tuning.CONFIG_DIR.glob("*/*.json")),
                         ids=lambda p: f"{p.parent.name}/{p.name}")
def test_shipped_tuning_files_hold_entries_their_op_reads(path):
    assert path.parent.name in CONFIGS, f"{path}: no op {path.parent.name!r} reads it"
    config, other = CONFIGS[path.parent.name]
    table = json.loads(path.read_text())
    assert table
    for shape, buckets in table.items():
        for bucket, entry in buckets.items():
            if entry == other:
                continue
            assert isinstance(entry, dict) and set(entry) <= set(config._fields), \
                f"{path} {shape} {bucket}: {entry} is not a {config.__name__}"
            assert all(isinstance(v, (int, bool)) for v in entry.values())
