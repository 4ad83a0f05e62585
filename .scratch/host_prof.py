import cProfile, pstats, random, sys, time
from pathlib import Path
sys.path.insert(0, "benchmarks")
from spec_decode import ToldProposer, make_copying
from nanoserve.bench.shapes import make_model_dir
from nanoserve import LLM, SamplingParams
d = make_model_dir("tiny-qwen3", Path("/tmp/cm2"))
llm = LLM(str(d), load_format="dummy", device="cpu", max_model_len=1024, max_num_seqs=64,
          enable_prefix_caching=False, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
make_copying(llm)
eng = llm.engine
rng = random.Random(0)
ps = [[rng.randrange(10000) for _ in range(128)] for _ in range(64)]
par = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
spec = eng.spec
eng.spec = eng.scheduler.proposer = None
outs = llm.generate(ps, par, use_tqdm=False)
t = time.perf_counter(); llm.generate(ps, par, use_tqdm=False); print("plain", time.perf_counter() - t)
eng.spec = spec
eng.scheduler.proposer = ToldProposer(llm, {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}, 4, 1.0, 151936)
llm.generate(ps, par, use_tqdm=False)
t = time.perf_counter(); llm.generate(ps, par, use_tqdm=False); print("spec", time.perf_counter() - t, eng.stats().spec.num_drafts)
pr = cProfile.Profile(); pr.enable(); llm.generate(ps, par, use_tqdm=False); pr.disable()
pstats.Stats(pr).sort_stats("cumulative").print_stats(45)
