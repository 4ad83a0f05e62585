"""Launch choice of RMSNorm, SiLU*mul, q/k-norm + RoPE + store and sampling: tuning-table
entries over each op's heuristic, which is the launch the ops had before they were tunable."""
import os

# Must precede any triton import: the kernels then run on CPU tensors through the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

from collections.abc import Callable  # noqa: E402
from typing import NamedTuple  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from nanoserve.kernels import fused_ops, qk_norm_rope, sampling  # noqa: E402
from nanoserve.kernels.fused_ops import RmsNormConfig, SiluAndMulConfig  # noqa: E402
from nanoserve.kernels.qk_norm_rope import QkNormRopeConfig  # noqa: E402
from nanoserve.kernels.sampling import SamplingConfig  # noqa: E402

CPU = torch.device("cpu")


class Op(NamedTuple):
    """One op's table rule at a fixed shape: ``lookup(table, rows)``, its table's key for that
    shape, the bucket 3 rows fall in, and an entry setting every field."""

    lookup: Callable[[dict, int], tuple]
    heuristic: tuple
    key: str
    bucket: str
    entry: dict


OPS = {
    "rms_norm": Op(lambda t, rows: fused_ops.rms_norm_from_table(t, rows, 4096),
                   fused_ops.rms_norm_heuristic_config(4096), "4096", "4", {"num_warps": 2}),
    "silu_and_mul": Op(lambda t, rows: fused_ops.silu_and_mul_from_table(t, rows, 11008),
                       fused_ops.silu_and_mul_heuristic_config(11008), "11008", "4",
                       {"block_n": 2048, "num_warps": 16}),
    "qk_norm_rope": Op(lambda t, rows: qk_norm_rope.from_table(t, rows, 32, 8, 128),
                       qk_norm_rope.heuristic_config(32, 8, 128), "32x8x128", "4",
                       {"num_warps": 4}),
    "sampling": Op(lambda t, rows: sampling.from_table(t, rows, 151936),
                   sampling.heuristic_config(3), "151936", "4",
                   {"tile": 4096, "tiles_per_chunk": 1, "num_warps": 8}),
}


@pytest.mark.parametrize("name", OPS)
def test_table_entries_over_the_heuristic(name):
    op = OPS[name]
    assert op.lookup({}, 3) == op.heuristic
    full = op.lookup({op.key: {op.bucket: op.entry}}, 3)
    assert full._asdict() == op.entry and full != op.heuristic
    # An entry tunes the fields it names; the heuristic keeps the others.
    field, value = next(iter(op.entry.items()))
    assert op.lookup({op.key: {op.bucket: {field: value}}}, 3) == \
        op.heuristic._replace(**{field: value})
    # Another bucket's or another shape's entry does not apply.
    assert op.lookup({op.key: {"1": op.entry, "64": op.entry}}, 3) == op.heuristic
    assert op.lookup({"1x" + op.key: {op.bucket: op.entry}}, 3) == op.heuristic
    with pytest.raises(ValueError, match="block_k"):
        op.lookup({op.key: {op.bucket: {**op.entry, "block_k": 64}}}, 3)


def test_untuned_launches_are_the_former_constants():
    """Nobody has timed these ops on a GPU yet: an untuned launch must be the launch as it was
    (fused_ops' ~8 elements a thread up to 8 warps, SiLU tiles of 1024, sampling's 2048-logit
    tiles, 2 to 16 a program, 4 warps)."""
    assert fused_ops.rms_norm_heuristic_config(4096) == RmsNormConfig(8)
    assert fused_ops.rms_norm_heuristic_config(1024) == RmsNormConfig(4)
    assert fused_ops.rms_norm_heuristic_config(96) == RmsNormConfig(1)
    assert fused_ops.silu_and_mul_heuristic_config(11008) == SiluAndMulConfig() \
        == SiluAndMulConfig(1024, 4)
    assert fused_ops.silu_and_mul_heuristic_config(300) == SiluAndMulConfig(512, 2)
    assert qk_norm_rope.heuristic_config(32, 8, 128) == QkNormRopeConfig(8)
    assert qk_norm_rope.heuristic_config(16, 8, 128) == QkNormRopeConfig(4)
    assert qk_norm_rope.heuristic_config(4, 2, 64) == QkNormRopeConfig(1)
    assert sampling.heuristic_config(1) == SamplingConfig() == SamplingConfig(2048, 2, 4)
    assert [sampling.heuristic_config(b).tiles_per_chunk for b in (16, 17, 64, 65, 1000)] \
        == [2, 4, 8, 16, 16]


def test_off_cuda_select_is_the_heuristic_on_interpreter_tiles():
    assert fused_ops.rms_norm_select(7, 4096, CPU) == fused_ops.rms_norm_heuristic_config(4096)
    assert fused_ops.silu_and_mul_select(7, 300, CPU) == \
        fused_ops.silu_and_mul_heuristic_config(300)
    assert qk_norm_rope.select(7, 32, 8, 128, CPU) == qk_norm_rope.heuristic_config(32, 8, 128)
    assert sampling.select(100, 1000, CPU) == SamplingConfig(sampling.INTERPRETER_TILE, 16, 4)


@pytest.mark.parametrize("candidates,heuristic", [
    (fused_ops.rms_norm_candidates(4096), fused_ops.rms_norm_heuristic_config(4096)),
    (fused_ops.rms_norm_candidates(128), fused_ops.rms_norm_heuristic_config(128)),
    (fused_ops.silu_and_mul_candidates(11008), fused_ops.silu_and_mul_heuristic_config(11008)),
    (fused_ops.silu_and_mul_candidates(768), fused_ops.silu_and_mul_heuristic_config(768)),
    (qk_norm_rope.candidates(32, 8, 128), qk_norm_rope.heuristic_config(32, 8, 128)),
    (sampling.candidates(1), sampling.heuristic_config(1)),
    (sampling.candidates(256), sampling.heuristic_config(256)),
])
def test_candidates_are_a_few_distinct_launches_with_the_heuristic_first(candidates, heuristic):
    assert candidates[0] == heuristic
    assert 4 <= len(candidates) == len(set(candidates)) <= 16


def test_start_up_compile_covers_each_tuned_launch(monkeypatch):
    """With a tuning table, batches compile by launch, not by the heuristic's chunk width: a
    bucket with its own warps compiles apart, one whose launch another's equals does not."""
    table = {"50": {"2": {"tiles_per_chunk": 4}, "8": {"num_warps": 8}}}
    monkeypatch.setattr(sampling, "interpreted", lambda device: False)
    monkeypatch.setattr(sampling, "load_table", lambda op, device: table if op == "sampling"
                        else {})
    compiled = []
    monkeypatch.setattr(sampling, "sample_tokens",
                        lambda logits, temperature, seed, bitmask=None:
                        compiled.append(logits.shape[0]))
    sampling.compile_for_batches(100, 50, torch.float32, CPU)
    # 3-4 and 9-16 launch as 1; 17-32 (4 tiles a chunk by the heuristic) as 2; 5-8 take 8 warps.
    assert sorted(set(compiled)) == [1, 2, 5, 33, 65]
    assert len(compiled) == 2 * 5  # with and without a bitmask
