"""Batch-1 decode layers (Qwen3-0.6B's shape, attention left out) as one persistent CUDA
kernel whose weights stream ahead into shared memory: an experiment, not used by the engine.

The question it answers: does a layer's chain of four dependent GEMVs get much cheaper than
the engine's programmatically launched Triton kernels (``split_decode_chain.py --variants
none``: 0.427 ms for 28 layers, run 128) once the weights no longer wait on the chain? The
kernel (``cuda_layer_chain.cu``) is built here with nvcc and launched through the CUDA driver
(ctypes), so it needs nothing beyond torch and the CUDA toolkit. Per variant it prints one
JSON line: the check against a PyTorch reference, microseconds per 28-layer forward (CUDA
graph replays, weights distinct per layer so that every replay streams them from HBM), the
bandwidth that is, and with ``--stamps`` where a layer's time goes (every block reads the
GPU's nanosecond clock as it passes a barrier, gets its first weights, and arrives).

    python benchmarks/cuda_layer_chain.py --variants default CONSUMER_WARPS=4 STREAM_ONLY=1
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import subprocess
import tempfile
from pathlib import Path

import torch
from common import emit, environment, replay_ms

SOURCE = Path(__file__).with_suffix(".cu")
HIDDEN, QKV, Q, INTER, PHASES = 1024, 4096, 2048, 3072, 4
# The kernel's stamps per block, layer and phase (enum Stamp in the .cu file).
GT_START, CLK_START, CLK_INPUTS, CLK_SUMS, CLK_ARRIVED, GT_DONE, STAMPS = range(7)
PHASE_NAMES = ("qkv", "o_proj", "gate_up", "down")
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Variant:
    """One build of the kernel: its -D settings, the cubin and the driver's handle to it."""

    def __init__(self, spec: str, build_dir: Path):
        self.spec = spec
        self.defines = dict(item.split("=") for item in spec.split(",")) if spec != "default" \
            else {}
        self.warps = int(self.defines.get("CONSUMER_WARPS", 8))
        self.shared_bytes = int(self.defines.get("SLOTS", 13)) * int(
            self.defines.get("SLOT_BYTES", 16384))
        cubin = build_dir / f"{spec.replace('=', '_').replace(',', '-')}.cubin"
        flags = [f"-D{k}={v}" for k, v in self.defines.items()]
        built = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-O3", "-lineinfo",
                                "--resource-usage", *flags, "-o", str(cubin), str(SOURCE)],
                               capture_output=True, text=True, check=True)
        self.resources = [line.strip() for line in built.stderr.splitlines() if "Used" in line]
        self.function = _load(cubin, "layer_chain", self.shared_bytes)

    def launch(self, args: list, grid: int) -> None:
        values = [ctypes.c_void_p(a) if isinstance(a, int) else a for a in args]
        pointers = (ctypes.c_void_p * len(values))(
            *[ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        _check(_driver().cuLaunchKernel(self.function, grid, 1, 1, 32 * (self.warps + 1), 1, 1,
                                        self.shared_bytes, stream, pointers, None),
               "cuLaunchKernel")


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what} failed with CUDA driver error {status}")


def _load(cubin: Path, name: str, shared_bytes: int) -> ctypes.c_void_p:
    torch.cuda.init()
    torch.zeros(1, device="cuda")  # makes the primary context current on this thread
    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    _check(_driver().cuModuleLoad(ctypes.byref(module), str(cubin).encode()), "cuModuleLoad")
    _check(_driver().cuModuleGetFunction(ctypes.byref(function), module, name.encode()),
           "cuModuleGetFunction")
    _check(_driver().cuFuncSetAttribute(function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                        shared_bytes), "cuFuncSetAttribute")
    return function


class Stack:
    """Random weights for ``layers`` layers, stacked per matrix, and the step's vectors."""

    def __init__(self, layers: int, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def weight(n: int, k: int) -> torch.Tensor:
            w = torch.randn(layers, n, k, device="cuda", generator=gen) * k ** -0.5
            return w.to(torch.bfloat16)

        self.layers = layers
        self.w_qkv, self.w_o = weight(QKV, HIDDEN), weight(HIDDEN, Q)
        self.w_gate_up, self.w_down = weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER)
        self.h0 = torch.randn(HIDDEN, device="cuda", generator=gen).to(torch.bfloat16)
        self.residual = torch.empty_like(self.h0)
        self.qkv = torch.empty(QKV, dtype=torch.bfloat16, device="cuda")
        self.act = torch.empty(INTER, dtype=torch.bfloat16, device="cuda")
        self.arrived = torch.zeros(1, dtype=torch.int32, device="cuda")
        self.failed = torch.zeros(1, dtype=torch.int32, device="cuda")

    def weight_bytes(self) -> int:
        return sum(w.numel() * 2 for w in (self.w_qkv, self.w_o, self.w_gate_up, self.w_down))

    def args(self, stamps: torch.Tensor | None, eps: float) -> list:
        return [self.w_qkv.data_ptr(), self.w_o.data_ptr(), self.w_gate_up.data_ptr(),
                self.w_down.data_ptr(), self.residual.data_ptr(), self.qkv.data_ptr(),
                self.act.data_ptr(), self.arrived.data_ptr(), self.failed.data_ptr(),
                0 if stamps is None else stamps.data_ptr(), ctypes.c_int(self.layers),
                ctypes.c_float(eps)]

    def run(self, variant: Variant, grid: int, eps: float,
            stamps: torch.Tensor | None = None) -> None:
        self.residual.copy_(self.h0)
        self.arrived.zero_()
        variant.launch(self.args(stamps, eps), grid)

    def reference(self, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The same chain in float32 on the GPU, rounded to bf16 where the kernel rounds."""
        bf = torch.bfloat16
        h = self.h0.clone()
        for layer in range(self.layers):
            x = h.float()
            scale = torch.rsqrt(x.square().mean() + eps)
            qkv = (self.w_qkv[layer].float() @ x * scale).to(bf)
            h = (h.float() + (self.w_o[layer].float() @ qkv[:Q].float()).to(bf).float()).to(bf)
            x = h.float()
            gate_up = self.w_gate_up[layer].float() @ x * torch.rsqrt(x.square().mean() + eps)
            gate, up = gate_up[0::2], gate_up[1::2]
            act = (gate * torch.sigmoid(gate) * up).to(bf)
            h = (h.float() + (self.w_down[layer].float() @ act.float()).to(bf).float()).to(bf)
        return h, qkv, act


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def stamp_profile(stamps: torch.Tensor) -> dict:
    """µs per layer and phase, averaged over all layers but the first. From the GPU's
    nanosecond clock (coarse, but common to all blocks): the span from the first block
    passing the phase's barrier to the first passing the next, and the barrier (the last
    arrival to the first block passing the next one). From each SM's cycle counter (fine, per
    block; converted at the clock rate the run shows), the median block's steps: its inputs
    (the phase's weight slots and input vector), the dot products with the norm and the
    stores, and its arrival; and the slowest block's whole phase."""
    s = stamps.double()  # [grid, layers, phases, STAMPS]
    grid, layers = s.shape[0], s.shape[1]
    flat = s.reshape(grid, layers * PHASES, STAMPS)
    ghz = ((flat[:, -1, CLK_ARRIVED] - flat[:, 0, CLK_START])
           / (flat[:, -1, GT_DONE] - flat[:, 0, GT_START])).mean().item()
    us = flat / 1e3
    cycles_us = flat / (ghz * 1e3)
    rows: dict = {"sm_clock_ghz": round(ghz, 3)}
    for p, name in enumerate(PHASE_NAMES):
        idx = torch.arange(PHASES + p, layers * PHASES - 1, PHASES)  # layers 1.., a next phase
        nxt = us[:, idx + 1, GT_START].min(0).values

        def median(a: int, b: int) -> float:
            d = cycles_us[:, idx, b] - cycles_us[:, idx, a]
            return round(d.median(0).values.mean().item(), 3)

        rows[name] = {
            "span": round((nxt - us[:, idx, GT_START].min(0).values).mean().item(), 3),
            "barrier": round((nxt - us[:, idx, GT_DONE].max(0).values).mean().item(), 3),
            "inputs": median(CLK_START, CLK_INPUTS),
            "dots": median(CLK_INPUTS, CLK_SUMS),
            "arrive": median(CLK_SUMS, CLK_ARRIVED),
            "work_max": round((cycles_us[:, idx, CLK_ARRIVED] - cycles_us[:, idx, CLK_START])
                              .max(0).values.mean().item(), 3),
        }
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--variants", nargs="+", default=["default"],
                        help="'default' or NAME=VALUE,... of the .cu file's -D settings")
    parser.add_argument("--grid", type=int, nargs="+", default=[0],
                        help="blocks (0: one per SM; more than that cannot all be resident)")
    parser.add_argument("--replays", type=int, default=300)
    parser.add_argument("--stamps", action="store_true")
    parser.add_argument("--eps", type=float, default=1e-6)
    args = parser.parse_args()

    env = environment()
    stack = Stack(args.layers)
    want, want_qkv, want_act = stack.reference(args.eps)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    with tempfile.TemporaryDirectory() as build:
        for spec in args.variants:
            variant = Variant(spec, Path(build))
            for grid in (g or sms for g in args.grid):
                record = {"bench": "cuda_layer_chain", "variant": spec, "grid": grid,
                          "layers": args.layers, "resources": variant.resources, **env}
                if grid > sms:
                    record["skipped"] = f"{grid} blocks cannot all be resident on {sms} SMs"
                    emit(record)
                    continue
                stack.failed.zero_()
                stack.run(variant, grid, args.eps)
                torch.cuda.synchronize()
                record["failed"] = bool(stack.failed.item())
                record["error_residual"] = relative_error(stack.residual, want)
                record["error_qkv"] = relative_error(stack.qkv, want_qkv)
                record["error_act"] = relative_error(stack.act, want_act)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    stack.run(variant, grid, args.eps)
                ms = replay_ms(graph, args.replays)
                record["forward_us"] = round(ms * 1e3, 2)
                record["us_per_layer"] = round(ms * 1e3 / args.layers, 3)
                record["weight_tbps"] = round(stack.weight_bytes() / ms / 1e9, 3)
                if args.stamps:
                    stamps = torch.zeros(grid, args.layers, PHASES, STAMPS, dtype=torch.int64,
                                         device="cuda")
                    stack.run(variant, grid, args.eps, stamps)
                    torch.cuda.synchronize()
                    record["per_layer_us"] = stamp_profile(stamps)
                record["failed"] = record["failed"] or bool(stack.failed.item())
                emit(record)


if __name__ == "__main__":
    main()
