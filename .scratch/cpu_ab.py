import sys, time, random
import nanoserve.runner.host_memory as hm
if sys.argv[1] == "off":
    hm.keep_freed_memory = lambda: False
    import nanoserve.runner.model_runner as mr; mr.keep_freed_memory = hm.keep_freed_memory
from nanoserve import LLM, SamplingParams
llm = LLM(device="cpu")
rng = random.Random(0)
words = "the of and to in is was for on that with as by at from his her an which it be or are".split()
prompts = [" ".join(rng.choice(words) for _ in range(rng.randint(300, 450))) for _ in range(32)]
sp = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
llm.generate(prompts[:2], sp, use_tqdm=False)
t = time.perf_counter(); out = llm.generate(prompts, sp, use_tqdm=False); dt = time.perf_counter() - t
n = sum(len(o.outputs[0].token_ids) for o in out)
t = time.perf_counter(); one = llm.generate(["Tell me a story about a cat."], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False); d1 = time.perf_counter() - t
print(sys.argv[1], f"32 prompts: {dt:.1f} s, {n/dt:.1f} out tok/s; single: {64/d1:.1f} tok/s")
