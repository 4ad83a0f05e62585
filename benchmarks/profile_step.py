"""Where a decode step's host time goes: cProfile of batch-1 and batch-N greedy generation."""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import random
import tempfile
from pathlib import Path

from common import SHAPES, make_model_dir

from nanoserve import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    random.seed(0)
    prompts = [[random.randint(0, 10000) for _ in range(128)] for _ in range(args.batch)]
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(str(make_model_dir(args.shape, Path(tmp) / "m")), load_format="dummy",
                  max_num_seqs=max(8, args.batch))
        llm.generate(prompts, params, use_tqdm=False)
        profile = cProfile.Profile()
        profile.enable()
        llm.generate(prompts, params, use_tqdm=False)
        profile.disable()
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats("tottime").print_stats(args.top)
    print(f"batch={args.batch} new_tokens={args.new_tokens}")
    print(out.getvalue())


if __name__ == "__main__":
    main()
