"""Host lists of numbers to device tensors in one pinned, asynchronous copy."""
from __future__ import annotations

import numpy as np
import torch

TENSOR_ALIGNMENT = 16  # bytes; see packed_to_device
TORCH_DTYPES = {np.int64: torch.int64, np.int32: torch.int32, np.float32: torch.float32}


def packed_to_device(parts: list[tuple[list | np.ndarray, type]], device: torch.device
                     ) -> list[torch.Tensor]:
    """Each ``(values, numpy dtype)`` of ``parts`` (a list or a 1-D array) as a 1-D tensor of
    that dtype on ``device``: one host buffer, one (pinned, asynchronous) copy, the tensors
    views of it, so no dtype conversion runs on the device. Each view starts on a 16-byte
    boundary: Triton specialises pointer arguments on that alignment, so varying offsets would
    compile new kernel variants."""
    arrays = [np.asarray(values, dtype=dtype) for values, dtype in parts]
    starts, end = [], 0
    for array in arrays:
        starts.append(end)
        end += array.nbytes - array.nbytes % -TENSOR_ALIGNMENT
    # Filled in place (the gaps stay unset: nothing reads them), pinned from the start on CUDA.
    host = torch.empty(end, dtype=torch.uint8, pin_memory=device.type == "cuda")
    buffer = host.numpy()
    for array, start in zip(arrays, starts):
        buffer[start:start + array.nbytes] = array.view(np.uint8)
    packed = host.to(device, non_blocking=True)
    return [packed[start:start + array.nbytes].view(TORCH_DTYPES[array.dtype.type])
            for array, start in zip(arrays, starts)]
