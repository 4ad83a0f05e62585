"""Host microseconds of F.linear at prefill row counts it has not seen before, then again, and
of ``repeat_interleave`` as ``prepare_inputs`` calls it, each timed with a 0.2 s sleep kernel
queued ahead so that a call that waits for the device shows as ~200,000 us (needs CUDA).

x is a strided slice of a wider tensor, so F.linear also copies it: the repeat times include
that copy. Prints one JSON object.

    python benchmarks/gemm_shape_cost.py
"""
import json

import torch
import torch.nn.functional as F
from common import host_us

DEV = "cuda"
ROWS = [16001, 15003, 14007, 13009, 12011, 11013, 10007, 9001]


def main() -> None:
    res = {}
    weights = {nk: torch.randn(*nk, device=DEV, dtype=torch.bfloat16)
               for nk in [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)]}
    xbig = torch.randn(16384, 3072, device=DEV, dtype=torch.bfloat16)
    for (n, k), w in weights.items():
        first, again = [], []
        for m in ROWS:
            x = xbig[:m, :k]
            first.append(host_us(lambda: F.linear(x, w)))
            again.append(host_us(lambda: F.linear(x, w)))
        res[f"{n}x{k}"] = {"first_call_us": first, "repeat_us": again}
    q = torch.randint(1, 1000, (30,), device=DEV, dtype=torch.int64)
    total = int(q.sum())
    seqs = torch.arange(30, device=DEV)
    res["repeat_interleave_us"] = [
        host_us(lambda: torch.repeat_interleave(seqs, q, output_size=total)) for _ in range(3)]
    q32 = q.to(torch.int32)
    res["repeat_interleave_int32_us"] = [
        host_us(lambda: torch.repeat_interleave(seqs, q32, output_size=total)) for _ in range(3)]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
