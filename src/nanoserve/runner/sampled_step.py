"""A launched step's samples on their way from the device to the host."""
from __future__ import annotations

import torch

from nanoserve.runner.inputs import StepOutput
from nanoserve.runner.sampler import SamplerOutput


class SampledStep:
    """The sampled tokens (and logprobs) of a launched step, copied to pinned host memory
    right behind its sampling, so ``result()`` waits for this step alone.
    ``logprobs_wanted[i]`` is how many top logprobs row ``i`` asked for (None: none);
    ``prompt_logprobs`` (already on the host) is passed through to the result."""

    def __init__(self, out: SamplerOutput, logprobs_wanted: list[int | None],
                 prompt_logprobs: dict[str, list[dict[int, float]]] | None = None):
        self.logprobs_wanted = logprobs_wanted
        self.prompt_logprobs = prompt_logprobs or {}
        tensors = [out.token_ids]
        if out.logprobs is not None:
            tensors += [out.logprobs, out.logprob_token_ids]
        self.event: torch.cuda.Event | None = None
        if out.token_ids.is_cuda:
            self.host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
            for dst, src in zip(self.host, tensors):
                dst.copy_(src, non_blocking=True)
            self.event = torch.cuda.Event()
            # The copies run on the source device's stream, which need not be the current one.
            self.event.record(torch.cuda.current_stream(out.token_ids.device))
        else:
            self.host = tensors

    def result(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        token_ids = self.host[0].tolist()
        if len(self.host) == 1:
            return StepOutput(token_ids, prompt_logprobs=self.prompt_logprobs)
        values, ids = self.host[1].tolist(), self.host[2].tolist()
        # Row layout: the sampled token, then the top-k.
        logprobs = [None if k is None else dict(zip(row_ids[:k + 1], row_values[:k + 1]))
                    for k, row_values, row_ids in zip(self.logprobs_wanted, values, ids)]
        return StepOutput(token_ids, logprobs, self.prompt_logprobs)
