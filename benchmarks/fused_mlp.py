"""The batch-1 MLP in one launch (``kernels/fused_mlp.py``) against the two GEMVs it replaces. Needs CUDA.

For the Qwen3-0.6B and Qwen3-8B MLP shapes: checks the fused kernel against gate/up with the
norm + down with the residual add (``skinny_rms_linear`` then ``skinny_linear(gated=True,
residual=...)``) on the same inputs, then times both as CUDA-graph replays that cycle through
enough weight copies to defeat the L2, programmatically launched back to back as in a decode
step. ``--sweep`` times every tiling of the grid below. One JSON line per shape; the last field,
``best_spec``, is the best tiling in ``latency.py --variant fused_mlp=...``'s syntax.

    python benchmarks/fused_mlp.py [--sweep] [--shapes qwen3-8b]
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch
from common import graph_us

from nanoserve.kernels.fused_mlp import FusedMLPConfig, FusedMLPScratch, default_config, fused_mlp
from nanoserve.kernels.skinny_gemm import skinny_linear, skinny_rms_linear

SHAPES = {"qwen3-0.6b": (1024, 3072), "qwen3-8b": (4096, 12288)}
ROTATE_BYTES = 512 << 20
EPS = 1e-6
DTYPE = torch.bfloat16


def sweep_configs() -> list[FusedMLPConfig]:
    """Intermediate features per program x gate/up chunk (at most 8k weights per chunk: the
    larger spill, ``kernel_registers.py --fused-mlp``) x warps x deferred sums; the down
    loop's chunk is 512."""
    return [FusedMLPConfig(bi, bh, 512, w, d) for bi, bh, w, d in itertools.product(
        (4, 8, 16, 32), (256, 512, 1024), (4, 8), (True, False)) if bi * bh <= 8192]


def bench(shape: str, sweep: bool, gen: torch.Generator) -> dict:
    hidden, inter = SHAPES[shape]
    per_copy = 3 * hidden * inter * 2
    copies = []
    for _ in range(max(2, -(-ROTATE_BYTES // per_copy))):
        w_gate_up = torch.randn(2 * inter, hidden, generator=gen, device="cuda",
                                dtype=DTYPE) / hidden ** 0.5
        w_down = torch.randn(hidden, inter, generator=gen, device="cuda", dtype=DTYPE) / inter ** 0.5
        copies.append((w_gate_up, w_down, w_down.t().contiguous().t()))
    h0 = torch.randn(1, hidden, generator=gen, device="cuda", dtype=DTYPE)
    ss0 = h0.float().square().sum().reshape(1)
    scratch = FusedMLPScratch(hidden, h0.device)

    # Correctness on fresh copies of the inputs: fused against the two GEMVs.
    w_gate_up, w_down, w_down_t = copies[0]
    two = h0.clone()
    ss_two = torch.zeros(1, device="cuda")
    skinny_linear(skinny_rms_linear(two, ss0, EPS, w_gate_up), w_down, gated=True,
                  residual=two, sum_squares=ss_two)

    def check(config: FusedMLPConfig | None) -> float:
        fused, ss_fused = h0.clone(), torch.zeros(1, device="cuda")
        fused_mlp(fused, ss0, EPS, w_gate_up, w_down_t, ss_fused, scratch, config)
        assert not scratch.acc.any() and scratch.count.item() == 0, "scratch left dirty"
        assert torch.allclose(ss_fused, ss_two, rtol=1e-2), (ss_fused, ss_two)
        return ((fused.float() - two.float()).abs().max() / two.float().abs().max()).item()

    # Timing: h and the sums change from call to call; the work does not.
    h, ss_in, ss_out = h0.clone(), ss0.clone(), torch.zeros(1, device="cuda")

    def two_gemvs(w_gu: torch.Tensor, w_d: torch.Tensor) -> None:
        skinny_linear(skinny_rms_linear(h, ss_in, EPS, w_gu), w_d, gated=True, residual=h,
                      sum_squares=ss_out)

    two_us = graph_us([lambda c=c: two_gemvs(c[0], c[1]) for c in copies])
    default = default_config(hidden, inter, h.device)
    row = {"bench": "fused_mlp", "shape": shape, "hidden": hidden, "intermediate": inter,
           "two_gemvs_us": round(two_us, 2),
           "two_gemvs_gbs": round(per_copy / two_us / 1e3, 1),
           "default": default._asdict(), "default_max_rel_err": check(None)}
    timed = []
    for config in (sweep_configs() if sweep else [default]):
        try:
            err = check(config)
            us = graph_us([lambda c=c, cfg=config: fused_mlp(h, ss_in, EPS, c[0], c[2], ss_out,
                                                              scratch, cfg) for c in copies])
        except Exception as exc:  # noqa: BLE001 - tiles past the SM's registers or memory
            timed.append((float("inf"), config, repr(exc)[:80]))
            continue
        timed.append((us, config, round(err, 5)))
    best_us, best, _ = min(timed, key=lambda t: t[0])
    row.update(fused_us=round(best_us, 2), fused_gbs=round(per_copy / best_us / 1e3, 1),
               best=best._asdict(), top5=[(round(u, 2), tuple(c), e)
                                          for u, c, e in sorted(timed, key=lambda t: t[0])[:5]],
               all=[(round(u, 2), tuple(c), e) for u, c, e in timed],
               best_spec="/".join(str(int(v)) for v in best))
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--shapes", nargs="+", default=sorted(SHAPES))
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    for shape in args.shapes:
        print(json.dumps(bench(shape, args.sweep, gen)), flush=True)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
