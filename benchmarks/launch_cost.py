"""Host microseconds per launch of the eager (prefill) path's ops, with the device kept busy
by a long sleep kernel queued first, so no call waits for the device (needs CUDA).

Admitting steps run eagerly: each layer's cuBLAS GEMMs and Triton kernels cost host time to
launch, and run 65 found those steps host-bound (host 47.8 ms against 44.5 of device time per
step). Prints one JSON object: F.linear per BLAS backend and shape, and two Triton kernels.

    python benchmarks/launch_cost.py
"""
import json

import torch
import torch.nn.functional as F

from common import host_us
from nanoserve.kernels.fused_ops import add_rms_norm, silu_and_mul

DEV = "cuda"
SHAPES = [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072), (151936, 1024)]  # (N, K)


def main() -> None:
    res = {}
    for backend in ["default", "cublas", "cublaslt"]:
        torch.backends.cuda.preferred_blas_library(backend)
        for m in [64, 8192, 16384]:
            for n, k in SHAPES:
                if n == 151936 and m > 64:  # the LM head only ever sees decode-size batches
                    continue
                x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
                w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
                F.linear(x, w)
                F.linear(x, w)
                res[f"{backend} linear m{m} {n}x{k}"] = host_us(lambda: F.linear(x, w), 100)
    torch.backends.cuda.preferred_blas_library("default")
    x = torch.randn(16384, 1024, device=DEV, dtype=torch.bfloat16)
    r = x.clone()
    g = torch.ones(1024, device=DEV, dtype=torch.bfloat16)
    add_rms_norm(x, r, g, 1e-6)
    res["add_rms_norm 16384"] = host_us(lambda: add_rms_norm(x, r, g, 1e-6), 200)
    y = torch.randn(16384, 6144, device=DEV, dtype=torch.bfloat16)
    silu_and_mul(y)
    res["silu 16384"] = host_us(lambda: silu_and_mul(y), 200)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
