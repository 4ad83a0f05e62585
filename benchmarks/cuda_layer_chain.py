"""The engine's batch-1 decode kernel (``src/nanoserve/kernels/layer_chain.cu``: every layer of
Qwen3-0.6B's shape in one persistent CUDA kernel whose weights stream ahead into shared
memory) on its own, in any build of its -D switches, against a PyTorch reference.

The question it answered first: how much cheaper than the engine's chain of programmatically
launched Triton kernels (``split_decode_chain.py``) does a batch-1 layer get once the weights
no longer wait on the chain? The kernel is built with nvcc (or ``--compiler nvrtc``) and
launched through the CUDA driver (nanoserve.kernels.cuda_build). A layer is qkv, attention
over a paged cache of ``--context`` keys plus the new one in splits (q/k norms, RoPE, the new
K/V stored), the splits' merge, o_proj, gate/up and down; ``ATTENTION=0`` leaves attention
out, as ``split_decode_chain.py --variants none`` does. Weights, caches and RoPE's table are
laid out as the engine holds them (a tensor per layer, gate/up as gate's rows then up's), and
the kernel reads the step's position from memory, so one captured graph serves successive
decode steps (``--steps``). Per variant it prints one JSON line: the check against a PyTorch
reference (at each step), microseconds per forward of ``--layers`` layers (CUDA graph
replays, weights distinct per layer so that every replay streams them from HBM), the
bandwidth that is, and with ``--stamps`` where a layer's time goes (every block reads the
GPU's clocks as it starts a stage, has its inputs, has its sums, and is done) and when each
stage's inputs were in and outputs out across the grid.

    python benchmarks/cuda_layer_chain.py --variants default ATTENTION=0 STREAM_ONLY=1
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import torch
from common import emit, environment, replay_ms

from nanoserve.kernels.cuda_build import CudaKernel, build_cubin
from nanoserve.kernels.layer_chain import (HEAD_DIM, HEADS, HIDDEN, INTERMEDIATE as INTER,
                                           KEYS_PER_WARP, KV_HEADS, QKV, SOURCE, AttentionArgs,
                                           TaggedArgs, Vocab, Weights, pointer_array,
                                           tagged_buffers)

Q = HEADS * HEAD_DIM
ROPE_THETA, BLOCK_SIZE = 1e6, 16
# A layer's stages (enum Stage in the .cu file), whose stamps the kernel keeps.
STAGE_NAMES = ("qkv", "attention", "merge", "o_proj", "gate_up", "down")
STAGES = len(STAGE_NAMES)
# The kernel's stamps per block, layer and stage (enum Stamp in the .cu file).
GT_START, CLK_START, CLK_INPUTS, CLK_SUMS, CLK_ARRIVED, GT_DONE, STAMPS = range(7)


def untag(words: torch.Tensor) -> torch.Tensor:
    """The bf16 values of tagged 32-bit words (value in the low half, tag in the high)."""
    return words.view(torch.int16).view(-1, 2)[:, 0].contiguous().view(torch.bfloat16)


class Variant:
    """One build of the kernel: its -D settings, and the loaded kernel."""

    def __init__(self, spec: str, compiler: str = "nvcc"):
        self.spec = spec
        self.defines = dict(item.split("=") for item in spec.split(",")) if spec != "default" \
            else {}
        self.warps = int(self.defines.get("CONSUMER_WARPS", 8))
        self.splits = int(self.defines.get("SPLITS", 16))
        self.keys_per_warp = int(self.defines.get("KEYS_PER_WARP", KEYS_PER_WARP))
        self.attention = self.defines.get("ATTENTION", "1") != "0"
        self.tagged = self.defines.get("TAGGED", "1") != "0"
        self.vocab = self.defines.get("VOCAB", "0") != "0"
        shared_bytes = int(self.defines.get("SLOTS", 13)) * int(
            self.defines.get("SLOT_BYTES", 16384))
        cubin, self.resources = build_cubin(SOURCE, self.defines, compiler=compiler)
        self.kernel = CudaKernel(cubin, "layer_chain", 32 * (self.warps + 1), shared_bytes)

    def launch(self, args: list, grid: int) -> None:
        self.kernel.launch(grid, args)


class Stack:
    """Random weights for ``layers`` layers and a paged K/V cache holding ``context`` keys per
    layer in shuffled blocks, laid out as the engine holds them (a tensor per layer, gate/up as
    gate's rows then up's), room for ``steps`` decode steps, and the step's vectors."""

    def __init__(self, layers: int, context: int, steps: int = 1, seed: int = 0,
                 vocab: int = 151936, device: str = "cuda"):
        gen = torch.Generator(device=device).manual_seed(seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, device=device, generator=gen)

        def weight(n: int, k: int) -> torch.Tensor:
            return (randn(layers, n, k) * k ** -0.5).to(torch.bfloat16)

        self.randn, self.layers, self.context = randn, layers, context
        self.w_qkv, self.w_o = weight(QKV, HIDDEN), weight(HIDDEN, Q)
        self.w_gate_up, self.w_down = weight(2 * INTER, HIDDEN), weight(HIDDEN, INTER)
        self.weight_pointers = [pointer_array(list(w), device) for w in
                                (self.w_qkv, self.w_o, self.w_gate_up, self.w_down)]
        self.q_norm = 1 + 0.1 * randn(layers, HEAD_DIM)
        self.k_norm = 1 + 0.1 * randn(layers, HEAD_DIM)
        blocks = (context + steps) // BLOCK_SIZE + 1
        cache_blocks = blocks + 3
        self.block_table = (torch.randperm(cache_blocks, device=device, generator=gen)[:blocks]
                            .to(torch.int32))
        shape = (cache_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        self.k_caches = [randn(*shape).to(torch.bfloat16) for _ in range(layers)]
        self.v_caches = [randn(*shape).to(torch.bfloat16) for _ in range(layers)]
        self.cache_pointers = (pointer_array(self.k_caches, device),
                               pointer_array(self.v_caches, device))
        positions = torch.arange(context + steps, device=device).float()
        angles = positions[:, None] * ROPE_THETA ** (
            -torch.arange(0, HEAD_DIM, 2, device=device) / HEAD_DIM)
        self.cos_sin = torch.cat([angles.cos(), angles.sin()], -1)  # as RotaryEmbedding's
        self.position = torch.full((1,), context, dtype=torch.int64, device=device)
        # A tied embedding and LM head, the final norm; the step's token and its row (VOCAB=0
        # builds start from the row, as the engine's embedding would hand it over).
        self.table = randn(vocab, HIDDEN).to(torch.bfloat16)
        self.final_norm = 1 + 0.1 * randn(HIDDEN)
        self.token = torch.zeros(1, dtype=torch.int64, device=device)
        self.token_index = torch.zeros(1, dtype=torch.int64, device=device)
        self.h0 = self.table[0].clone()
        self.residual = torch.empty_like(self.h0)
        self.normed = torch.empty_like(self.h0)
        self.logits = torch.empty(vocab, dtype=torch.bfloat16, device=device)
        self.qkv = torch.empty(QKV, dtype=torch.bfloat16, device=device)
        self.act = torch.empty(INTER, dtype=torch.bfloat16, device=device)
        self.attn = torch.empty(HEADS * HEAD_DIM, dtype=torch.bfloat16, device=device)
        self.head_done = torch.zeros(KV_HEADS, dtype=torch.int32, device=device)
        self.partials: dict[int, torch.Tensor] = {}  # per split count
        self.tagged = tagged_buffers(device)  # TAGGED=1's
        self.arrived = torch.zeros(1, dtype=torch.int32, device=device)
        self.failed = torch.zeros(1, dtype=torch.int32, device=device)

    def step(self, step: int) -> None:
        """Move to decode step ``step``: the next position, a fresh input row."""
        self.position.fill_(self.context + step)
        self.token.fill_(int(self.randn(1).abs().mul(1e4).long()) % self.table.shape[0])
        self.h0.copy_(self.table[self.token[0]])

    @property
    def current(self) -> int:
        return int(self.position.item())

    def weight_bytes(self, head: bool = False) -> int:
        """Bytes of the layers' weights, and with ``head`` the LM head's."""
        layers = sum(w.numel() * 2 for w in (self.w_qkv, self.w_o, self.w_gate_up, self.w_down))
        return layers + (self.table.numel() * 2 if head else 0)

    def slot(self, position: int) -> tuple[int, int]:
        return int(self.block_table[position // BLOCK_SIZE]), position % BLOCK_SIZE

    def cached(self, cache: torch.Tensor) -> torch.Tensor:
        """A layer's keys or values before the current position, ``[position, KV_HEADS,
        HEAD_DIM]``."""
        positions = torch.arange(self.current, device=cache.device)
        blocks = self.block_table[positions // BLOCK_SIZE].long()
        return cache[blocks, positions % BLOCK_SIZE]

    def args(self, variant: Variant, stamps: torch.Tensor | None, eps: float) -> list:
        if variant.splits not in self.partials:  # allocated once, outside any graph capture
            self.partials[variant.splits] = torch.empty(
                HEADS * variant.splits * (HEAD_DIM + 2), device="cuda")
        partials = self.partials[variant.splits]
        attention = AttentionArgs(self.cache_pointers[0].data_ptr(),
                                  self.cache_pointers[1].data_ptr(), self.block_table.data_ptr(),
                                  self.position.data_ptr(), 0, BLOCK_SIZE,
                                  self.cos_sin.data_ptr(), self.q_norm.data_ptr(),
                                  self.k_norm.data_ptr(), partials.data_ptr(),
                                  self.head_done.data_ptr(), self.attn.data_ptr())
        tagged = TaggedArgs(*(t.data_ptr() for t in self.tagged.values()))
        weights = Weights(*(p.data_ptr() for p in self.weight_pointers))
        vocab = Vocab(self.token_index.data_ptr(), self.token.data_ptr(), self.table.data_ptr(),
                      self.table.data_ptr(),
                      self.final_norm.data_ptr(), self.normed.data_ptr(),
                      self.logits.data_ptr(), 0, 0, self.table.shape[0])
        return [weights, self.residual.data_ptr(), self.qkv.data_ptr(),
                self.act.data_ptr(), attention, tagged, vocab, self.arrived.data_ptr(),
                self.failed.data_ptr(),
                0 if stamps is None else stamps.data_ptr(), ctypes.c_int(self.layers),
                ctypes.c_float(eps)]

    def run(self, variant: Variant, grid: int, eps: float,
            stamps: torch.Tensor | None = None, head: bool = False) -> None:
        """One launch; with ``head`` a build without VOCAB is followed by the engine's final
        norm and LM head in PyTorch (cuBLAS), so that it does the work VOCAB=1 does."""
        if not variant.vocab:
            self.residual.copy_(self.h0)
        self.arrived.zero_()
        self.head_done.zero_()
        variant.launch(self.args(variant, stamps, eps), grid)
        if head and not variant.vocab:
            normed = torch.nn.functional.rms_norm(self.residual.float(), (HIDDEN,),
                                                  self.final_norm, eps).to(torch.bfloat16)
            self.normed.copy_(normed)
            # x @ W^T as the engine's LM head calls it (F.linear's cuBLAS GEMM; runs 239 and
            # 241 timed W @ x, a slower kernel)
            torch.mm(normed[None], self.table.t(), out=self.logits[None])

    def attention(self, qkv: torch.Tensor, layer: int, eps: float) -> tuple[torch.Tensor, ...]:
        """Attention of the new token (float32, rounded where the kernel rounds): the output,
        and the new key and value as the cache stores them."""
        bf = torch.bfloat16

        def norm_rope(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
            x = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight
            cos, sin = self.cos_sin[self.current].chunk(2)
            first, second = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
            return torch.cat([first * cos - second * sin, second * cos + first * sin], -1).to(bf)

        q = norm_rope(qkv[:Q].float().view(HEADS, HEAD_DIM), self.q_norm[layer])
        k = norm_rope(qkv[Q:Q + KV_HEADS * HEAD_DIM].float().view(KV_HEADS, HEAD_DIM),
                      self.k_norm[layer])
        v = qkv[Q + KV_HEADS * HEAD_DIM:].view(KV_HEADS, HEAD_DIM)
        keys = torch.cat([self.cached(self.k_caches[layer]), k[None]]).float()
        values = torch.cat([self.cached(self.v_caches[layer]), v[None]]).float()
        group = HEADS // KV_HEADS
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        scores = torch.einsum("hd,jhd->hj", q.float(), keys) * HEAD_DIM ** -0.5
        out = torch.einsum("hj,jhd->hd", scores.softmax(-1), values)
        return out.reshape(-1).to(bf), k, v

    def reference(self, eps: float, attention: bool) -> dict[str, torch.Tensor]:
        """The same layers in float32 on the GPU, rounded to bf16 where the kernel rounds."""
        bf = torch.bfloat16
        h = self.h0.clone()
        new_keys, new_values = [], []
        for layer in range(self.layers):
            x = h.float()
            scale = torch.rsqrt(x.square().mean() + eps)
            qkv = (self.w_qkv[layer].float() @ x * scale).to(bf)
            attn = qkv[:Q]
            if attention:
                attn, k, v = self.attention(qkv, layer, eps)
                new_keys.append(k)
                new_values.append(v)
            h = (h.float() + (self.w_o[layer].float() @ attn.float()).to(bf).float()).to(bf)
            x = h.float()
            gate_up = self.w_gate_up[layer].float() @ x * torch.rsqrt(x.square().mean() + eps)
            gate, up = gate_up.chunk(2)
            act = (gate * torch.sigmoid(gate) * up).to(bf)
            h = (h.float() + (self.w_down[layer].float() @ act.float()).to(bf).float()).to(bf)
        x = h.float()
        normed = (x * torch.rsqrt(x.square().mean() + eps) * self.final_norm).to(bf)
        want = {"residual": h, "qkv": qkv, "act": act, "normed": normed,
                "logits": (self.table.float() @ normed.float()).to(bf)}
        if attention:
            want["attn"] = attn
            want["new_keys"], want["new_values"] = torch.stack(new_keys), torch.stack(new_values)
        return want

    def got(self, variant: Variant) -> dict[str, torch.Tensor]:
        """The kernel's outputs under the reference's names."""
        block, i = self.slot(self.current)
        got = {"residual": self.residual, "qkv": self.qkv, "act": self.act, "attn": self.attn,
               "normed": self.normed, "logits": self.logits,
               "new_keys": torch.stack([c[block, i] for c in self.k_caches]),
               "new_values": torch.stack([c[block, i] for c in self.v_caches])}
        if variant.tagged:
            got.update({name: untag(self.tagged[name]) for name in ("qkv", "act", "attn")})
        return got


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm()).item()


def errors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor],
           head: bool) -> dict[str, float]:
    """Each output's relative error against the reference, the head's outputs only where the
    launch ran the head."""
    return {f"error_{name}": relative_error(got[name], w) for name, w in want.items()
            if head or name not in ("normed", "logits")}


def stages_that_ran(stamps: torch.Tensor) -> list[int]:
    """The stages a variant ran (the others' stamps stay zero)."""
    return [p for p in range(STAGES) if stamps[:, :, p, GT_START].any()]


def sm_clock_ghz(stamps: torch.Tensor) -> float:
    """The SM clock the run shows: each block's cycles over nanoseconds from its first stage's
    start to its last stage's end, averaged over blocks."""
    s, ran = stamps.double(), stages_that_ran(stamps)
    first, last = s[:, 0, ran[0]], s[:, -1, ran[-1]]
    return ((last[:, CLK_ARRIVED] - first[:, CLK_START])
            / (last[:, GT_DONE] - first[:, GT_START])).mean().item()


def stamp_profile(stamps: torch.Tensor) -> dict:
    """µs per layer and stage, averaged over all layers but the first, for the stages that ran.
    From the GPU's nanosecond clock (coarse, but common to all blocks): the span from the first
    block passing the stage's barrier to the first passing the next, and the barrier (the last
    arrival to the first block passing the next one). From each SM's cycle counter (fine, per
    block; converted at the clock rate the run shows), the median block's steps: its inputs
    (a GEMV's weight slots and input vector), its work (dot products, or attention), and its
    arrival; and the slowest block's whole stage."""
    s = stamps.double()  # [grid, layers, STAGES, STAMPS]
    grid, layers = s.shape[0], s.shape[1]
    ran = stages_that_ran(stamps)
    order = [(layer, p) for layer in range(layers) for p in ran]
    flat = torch.stack([s[:, layer, p] for layer, p in order], 1)  # [grid, steps, STAMPS]
    ghz = sm_clock_ghz(stamps)
    us = flat / 1e3
    cycles_us = flat / (ghz * 1e3)
    rows: dict = {"sm_clock_ghz": round(ghz, 3)}
    for p in ran:
        idx = torch.tensor([i for i, (layer, q) in enumerate(order)
                            if q == p and layer >= 1 and i + 1 < len(order)])
        nxt = us[:, idx + 1, GT_START].min(0).values

        def median(a: int, b: int) -> float:
            d = cycles_us[:, idx, b] - cycles_us[:, idx, a]
            return round(d.median(0).values.mean().item(), 3)

        rows[STAGE_NAMES[p]] = {
            "span": round((nxt - us[:, idx, GT_START].min(0).values).mean().item(), 3),
            "barrier": round((nxt - us[:, idx, GT_DONE].max(0).values).mean().item(), 3),
            "inputs": median(CLK_START, CLK_INPUTS),
            "work": median(CLK_INPUTS, CLK_SUMS),
            "arrive": median(CLK_SUMS, CLK_ARRIVED),
            "work_max": round((cycles_us[:, idx, CLK_ARRIVED] - cycles_us[:, idx, CLK_START])
                              .max(0).values.mean().item(), 3),
        }
    return rows


def stamp_timeline(stamps: torch.Tensor, attention_blocks: int) -> dict:
    """When each stage's blocks had their inputs in ("ready": first, median and last block) and
    their outputs written ("done": median and last), in µs from the layer's first stage start,
    averaged over all layers but the first and the last; and each stage's "handoff": from the
    last block writing the previous stage's outputs to the median block having them in (the
    previous layer's last stage for the first). SM cycles become nanoseconds at
    ``sm_clock_ghz``. Attention counts only its first ``attention_blocks`` blocks, which
    have work; the others pass straight through."""
    s = stamps.double()  # [grid, layers, STAGES, STAMPS]
    layers = s.shape[1]
    ran = stages_that_ran(stamps)
    ghz = sm_clock_ghz(stamps)

    def ns(which: int) -> torch.Tensor:  # [grid, layers, STAGES], on the common clock
        return s[..., GT_START] + (s[..., which] - s[..., CLK_START]) / ghz

    ready, done = ns(CLK_INPUTS), ns(CLK_SUMS)
    middle = range(1, layers - 1)
    rows: dict = {}
    for i, p in enumerate(ran):
        blocks = slice(0, attention_blocks) if STAGE_NAMES[p] == "attention" else slice(None)
        before, layer_shift = (ran[i - 1], 0) if i else (ran[-1], 1)
        stats = []
        for layer in middle:
            start = s[:, layer, ran[0], GT_START].min()
            r = (ready[blocks, layer, p] - start) / 1e3
            d = (done[blocks, layer, p] - start) / 1e3
            handed = (done[:, layer - layer_shift, before].max() - start) / 1e3
            stats.append([r.min(), r.median(), r.max(), d.median(), d.max(),
                          r.median() - handed])
        mean = torch.tensor(stats).mean(0).tolist()
        rows[STAGE_NAMES[p]] = {"ready": [round(v, 3) for v in mean[:3]],
                                "done": [round(v, 3) for v in mean[3:5]],
                                "handoff": round(mean[5], 3)}
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
    parser.add_argument("--save-stamps", type=Path, default=None,
                        help="folder to save each variant's raw stamps in (torch.save)")
    parser.add_argument("--eps", type=float, default=1e-6)
    parser.add_argument("--context", type=int, default=384,
                        help="cached keys (a split holds at most KEYS_PER_WARP, by default 4, "
                             "keys per consumer warp)")
    parser.add_argument("--compiler", choices=("nvcc", "nvrtc"), default="nvcc",
                        help="nvrtc: NVRTC from the nvidia-cuda-nvrtc wheel, no CUDA toolkit")
    parser.add_argument("--steps", type=int, default=1,
                        help="decode steps checked, the later ones by replaying the timed graph "
                             "at the next positions (the kernel reads the position from memory)")
    parser.add_argument("--head", action="store_true",
                        help="time and check the final norm and LM head too: VOCAB=1 builds run "
                             "them inside, the others follow with PyTorch's (cuBLAS)")
    args = parser.parse_args()

    env = environment()
    stack = Stack(args.layers, args.context, args.steps)
    first_input = stack.h0.clone()  # the row of token 0
    references = {attention: stack.reference(args.eps, attention) for attention in (True, False)}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for spec in args.variants:
        variant = Variant(spec, args.compiler)
        for grid in (g or sms for g in args.grid):
            record = {"bench": "cuda_layer_chain", "variant": spec, "grid": grid,
                      "layers": args.layers, "context": args.context,
                      "resources": variant.resources, **env}
            if grid > sms:
                record["skipped"] = f"{grid} blocks cannot all be resident on {sms} SMs"
                emit(record)
                continue
            split_keys = variant.keys_per_warp * variant.warps
            keys = args.context + args.steps
            if variant.attention and keys > split_keys * variant.splits:
                record["skipped"] = f"{keys} keys do not fit {variant.splits} " \
                                    f"splits of {split_keys}"
                emit(record)
                continue
            stack.position.fill_(args.context)
            stack.h0.copy_(first_input)
            stack.token.zero_()
            stack.failed.zero_()
            head = args.head or variant.vocab
            record["head"] = head
            stack.run(variant, grid, args.eps, head=head)
            torch.cuda.synchronize()
            record["failed"] = bool(stack.failed.item())
            record.update(errors(stack.got(variant), references[variant.attention], head))
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                stack.run(variant, grid, args.eps, head=head)
            ms = replay_ms(graph, args.replays)
            record["forward_us"] = round(ms * 1e3, 2)
            record["us_per_layer"] = round(ms * 1e3 / args.layers, 3)
            record["weight_tbps"] = round(stack.weight_bytes(head) / ms / 1e9, 3)
            if args.stamps:
                stamps = torch.zeros(grid, args.layers, STAGES, STAMPS, dtype=torch.int64,
                                     device="cuda")
                stack.run(variant, grid, args.eps, stamps)
                torch.cuda.synchronize()
                record["per_layer_us"] = stamp_profile(stamps)
                record["timeline_us"] = stamp_timeline(stamps, KV_HEADS * variant.splits)
                if args.save_stamps is not None:
                    args.save_stamps.mkdir(parents=True, exist_ok=True)
                    torch.save(stamps.cpu(), args.save_stamps / f"{spec}-{grid}.pt")
            later = []
            for step in range(1, args.steps):
                stack.step(step)
                graph.replay()
                later.append({"position": stack.current,
                              **errors(stack.got(variant),
                                       stack.reference(args.eps, variant.attention), head)})
            if later:
                record["later_steps"] = later
            record["failed"] = record["failed"] or bool(stack.failed.item())
            emit(record)


if __name__ == "__main__":
    main()
