"""The engine's persistent CUDA layer kernel (src/nanoserve/kernels/layer_chain.cu) and its
benchmark driver (benchmarks/cuda_layer_chain.py) off the device: the kernel builds for sm_90
without spilling in every variant the device runs, a variant that would deadlock is refused at
build time, the profiles read the kernel's stamps as documented, tagged words decode, and the
PyTorch reference the device check trusts agrees with naive loops. The kernel itself runs
only on the H200 (tests/gpu/test_layer_chain_gpu.py, docs/kernels.md)."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from nanoserve.kernels.cuda_build import CudaBuildError, build_cubin, nvrtc_available
from nanoserve.kernels.layer_chain import SOURCE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import cuda_layer_chain as chain  # noqa: E402

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="no CUDA compiler here")


def build(*defines: str) -> list[str]:
    """ptxas's resource lines for the kernel built with ``defines`` (NAME=VALUE) by nvcc."""
    return build_cubin(SOURCE, dict(d.split("=") for d in defines), compiler="nvcc")[1]


@needs_nvcc
@pytest.mark.parametrize("defines", [(), ("TAGGED=0",), ("NO_WEIGHTS=1",), ("STREAM_ONLY=1",),
                                     ("NO_WEIGHTS=1", "NO_DOTS=1"),
                                     ("TAGGED=0", "NO_WEIGHTS=1", "BARRIER_ONLY=1"),
                                     ("INFLIGHT=0",), ("ATTENTION=0",), ("TAGGED=0", "ATTENTION=0"),
                                     ("SPLITS=8",), ("INFLIGHT=2",),
                                     ("TAGGED=0", "MERGE_AS_STAGE=0"), ("POLL_NS=0",),
                                     ("VOCAB=1",), ("VOCAB=1", "TAGGED=0"),
                                     ("VOCAB=1", "HEAD_INFLIGHT=4")])
def test_kernel_builds_for_sm90_without_spills(defines):
    resources = build(*defines)
    spills = [line for line in resources if "spill" in line]
    assert spills and all("0 bytes spill stores, 0 bytes spill loads" in line
                          for line in spills), resources


@needs_nvcc
@pytest.mark.skipif(not nvrtc_available(), reason="no nvidia-cuda-nvrtc / -runtime wheels here")
@pytest.mark.parametrize("defines", [{}, {"TAGGED": "0"}, {"ATTENTION": "0"}])
def test_nvrtc_from_the_nvidia_wheels_builds_what_nvcc_builds(defines):
    """Run-time compilation needs no CUDA toolkit: NVRTC and the bf16 header from the
    nvidia-cuda-nvrtc / -runtime wheels give a cubin with nvcc's shared memory and no spills.
    (Registers may differ a little: NVRTC 13.0.88 gives the default build 165, nvcc 13.0.88
    168; both fit the launch bounds of one 288-thread block per SM.)"""
    cubin, by_nvrtc = build_cubin(SOURCE, defines, compiler="nvrtc")
    by_nvcc = build_cubin(SOURCE, defines, compiler="nvcc")[1]
    assert cubin[:4] == b"\x7fELF"

    def shared(lines: list[str]) -> list[str]:
        return [line.split("registers, ")[1] for line in lines if "Used" in line]

    assert shared(by_nvrtc) and shared(by_nvrtc) == shared(by_nvcc)
    assert all("0 bytes spill stores, 0 bytes spill loads" in line
               for line in by_nvrtc if "spill" in line)


@needs_nvcc
def test_barrier_only_without_no_weights_is_refused():
    with pytest.raises(CudaBuildError, match="BARRIER_ONLY needs NO_WEIGHTS=1"):
        build("TAGGED=0", "BARRIER_ONLY=1")


@needs_nvcc
def test_tagged_without_the_data_a_barrier_orders_is_refused():
    for defines in (("TAGGED=1", "NO_WEIGHTS=1", "BARRIER_ONLY=1"),
                    ("TAGGED=1", "MERGE_AS_STAGE=0")):
        with pytest.raises(CudaBuildError, match="TAGGED needs the data a barrier would order"):
            build(*defines)


def test_without_any_compiler_the_build_says_so(monkeypatch):
    import nanoserve.kernels.cuda_build as cuda_build
    monkeypatch.setattr(cuda_build, "available_compiler", lambda: None)
    with pytest.raises(CudaBuildError, match="no CUDA compiler"):
        cuda_build.build_cubin(SOURCE, {})


def test_untag_reads_the_value_half_of_each_word():
    values = torch.randn(64).to(torch.bfloat16)
    tags = torch.randint(1, 65536, (64,), dtype=torch.int32)
    words = (tags << 16) | values.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF)
    assert torch.equal(chain.untag(words).view(torch.int16), values.view(torch.int16))


def synthetic_stamps(grid: int, layers: int, ghz: float) -> torch.Tensor:
    """Stamps of a run where every phase takes 5 µs: block b passes each barrier b ns after
    block 0, loads its inputs in 0.5 µs, sums in 1 µs, arrives 0.5 µs later; the last block's
    arrival comes 1 µs before the first block passes the next barrier."""
    stamps = torch.zeros(grid, layers, chain.STAGES, chain.STAMPS, dtype=torch.int64)
    phase = torch.arange(layers * chain.STAGES).view(1, layers, chain.STAGES) * 5000
    start = phase + torch.arange(grid).view(grid, 1, 1)
    stamps[..., chain.GT_START] = start
    stamps[..., chain.GT_DONE] = phase + 4000 - (grid - 1) + torch.arange(grid).view(grid, 1, 1)
    cycles = lambda ns: (ns * ghz).long()  # noqa: E731
    stamps[..., chain.CLK_START] = cycles(start)
    stamps[..., chain.CLK_INPUTS] = cycles(start + 500)
    stamps[..., chain.CLK_SUMS] = cycles(start + 1500)
    stamps[..., chain.CLK_ARRIVED] = cycles(stamps[..., chain.GT_DONE])
    return stamps


def test_stamp_profile_reads_spans_barriers_and_steps():
    profile = chain.stamp_profile(synthetic_stamps(grid=4, layers=3, ghz=1.5))
    assert profile["sm_clock_ghz"] == pytest.approx(1.5, rel=1e-3)
    for name in chain.STAGE_NAMES:
        row = profile[name]
        assert row["span"] == pytest.approx(5.0, abs=1e-3)
        assert row["barrier"] == pytest.approx(1.0, abs=1e-3)
        assert row["inputs"] == pytest.approx(0.5, abs=2e-3)
        assert row["work"] == pytest.approx(1.0, abs=2e-3)
        assert row["arrive"] == pytest.approx(4.0 - 3e-3 - 1.5, abs=3e-3)


def test_stamp_timeline_reads_ready_done_and_handoffs():
    """Synthetic stamps (above): a stage every 5 µs, inputs in 0.5 µs after each block starts
    (block b b ns late), outputs 1.5 µs after; attention's last block, which has no work, is
    given a wild inputs stamp that must not count."""
    stamps = synthetic_stamps(grid=4, layers=4, ghz=1.5)
    stamps[3, :, chain.STAGE_NAMES.index("attention"), chain.CLK_INPUTS] += 10**6
    timeline = chain.stamp_timeline(stamps, attention_blocks=3)
    for p, name in enumerate(chain.STAGE_NAMES):
        row = timeline[name]
        last = 2 if name == "attention" else 3  # the latest block that counts, ns behind block 0
        assert row["ready"] == pytest.approx([5 * p + 0.5, 5 * p + 0.501, 5 * p + 0.5 + last / 1e3],
                                             abs=1e-3)
        assert row["done"] == pytest.approx([5 * p + 1.501, 5 * p + 1.5 + last / 1e3], abs=1e-3)
        # from the stage before's last outputs, 5 * (p - 1) + 1.503, to the median block's inputs
        assert row["handoff"] == pytest.approx(5 - 1.002, abs=1e-3)


def test_reference_attention_matches_a_naive_loop_at_a_later_step():
    """The reference the device check trusts: its attention for the current position (after a
    step, so through the block table and RoPE's row for that position) against a per-head,
    per-position loop over the engine-layout caches."""
    stack = chain.Stack(layers=2, context=37, steps=3, vocab=1000, device="cpu")
    stack.step(2)
    position, eps = stack.current, 1e-6
    assert position == 39
    qkv = torch.randn(chain.QKV).to(torch.bfloat16)
    out, k_new, v_new = stack.attention(qkv, 1, eps)
    cos, sin = stack.cos_sin[position].chunk(2)
    half = chain.HEAD_DIM // 2
    angles = position * chain.ROPE_THETA ** (-torch.arange(0, chain.HEAD_DIM, 2) / chain.HEAD_DIM)
    assert torch.allclose(cos, angles.cos()) and torch.allclose(sin, angles.sin())

    def norm_rope(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x = x.float() * torch.rsqrt(x.float().square().mean() + eps) * weight
        return torch.cat([x[:half] * cos - x[half:] * sin,
                          x[half:] * cos + x[:half] * sin]).to(torch.bfloat16)

    q_size, group = chain.HEADS * chain.HEAD_DIM, chain.HEADS // chain.KV_HEADS
    for head in range(chain.HEADS):
        kv = head // group
        q = norm_rope(qkv[head * chain.HEAD_DIM:][:chain.HEAD_DIM], stack.q_norm[1]).float()
        k = norm_rope(qkv[q_size + kv * chain.HEAD_DIM:][:chain.HEAD_DIM], stack.k_norm[1])
        v = qkv[q_size + (chain.KV_HEADS + kv) * chain.HEAD_DIM:][:chain.HEAD_DIM]
        keys, values = [], []
        for p in range(position):
            block, i = stack.slot(p)
            keys.append(stack.k_caches[1][block, i, kv].float())
            values.append(stack.v_caches[1][block, i, kv].float())
        keys, values = torch.stack(keys + [k.float()]), torch.stack(values + [v.float()])
        weights = torch.softmax(keys @ q * chain.HEAD_DIM ** -0.5, 0)
        want = (weights @ values).to(torch.bfloat16)
        got = out[head * chain.HEAD_DIM:][:chain.HEAD_DIM]
        assert torch.allclose(got.float(), want.float(), atol=1e-2, rtol=1e-2)
        assert torch.equal(k_new[kv], k) and torch.equal(v_new[kv], v)


def test_reference_mlp_takes_gate_rows_then_up_rows():
    """One layer without attention, by hand: gate/up's first INTER rows are the gate, the rest
    the up projection, as the engine packs them."""
    stack = chain.Stack(layers=1, context=5, vocab=1000, device="cpu")
    want = stack.reference(1e-6, attention=False)
    x = stack.h0.float()
    qkv = (stack.w_qkv[0].float() @ x * torch.rsqrt(x.square().mean() + 1e-6)).to(torch.bfloat16)
    mid = (x + (stack.w_o[0].float() @ qkv[:chain.Q].float()).to(torch.bfloat16).float()) \
        .to(torch.bfloat16).float()
    scale = torch.rsqrt(mid.square().mean() + 1e-6)
    gate = stack.w_gate_up[0, :chain.INTER].float() @ mid * scale
    up = stack.w_gate_up[0, chain.INTER:].float() @ mid * scale
    expected = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(want["act"].float(), expected, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("nvcc, wheels, want", [("/usr/bin/nvcc", True, "nvcc"),
                                                 ("/usr/bin/nvcc", False, "nvcc"),
                                                 (None, True, "nvrtc"), (None, False, None)])
def test_the_compiler_is_nvcc_else_the_nvrtc_wheel(monkeypatch, nvcc, wheels, want):
    import nanoserve.kernels.cuda_build as cuda_build

    def wheel_file(pattern: str) -> Path:
        if not wheels:
            raise FileNotFoundError(pattern)
        return Path("/wheels") / pattern

    monkeypatch.setattr(cuda_build.shutil, "which", lambda name: nvcc)
    monkeypatch.setattr(cuda_build, "nvidia_wheel_file", wheel_file)
    assert cuda_build.available_compiler() == want
