"""Device: where a speculating engine's time goes (qwen3-0.6b copying model)."""
import json, os, random, sys, time
from pathlib import Path
import torch
sys.path.insert(0, "benchmarks")
from spec_decode import ToldProposer, make_copying
from nanoserve.bench.shapes import make_model_dir
from nanoserve import LLM, SamplingParams
from nanoserve.runner import model_runner as mr
from nanoserve.runner import spec_verify as sv

OUT = Path(os.environ.get("OUT", "/tmp/out"))
shape = sys.argv[1] if len(sys.argv) > 1 else "qwen3-0.6b"
d = make_model_dir(shape, Path("/tmp/m") / shape)
llm = LLM(str(d), load_format="dummy", max_model_len=1024, max_num_seqs=64,
          enable_prefix_caching=False,
          speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                              "prompt_lookup_min": 2, "prompt_lookup_max": 4})
make_copying(llm)
eng = llm.engine
rng = random.Random(0)
def prompts(b): return [[rng.randrange(10000) for _ in range(128)] for _ in range(b)]
def timed(ps, n):
    p = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    torch.cuda.synchronize(); t = time.perf_counter()
    outs = llm.generate(ps, p, use_tqdm=False)
    torch.cuda.synchronize(); return time.perf_counter() - t, outs
res = {}
plain_verify = mr.ModelRunner._verify
def eager_sampled_verify(self, *a):
    saved_t = mr.temperatures_only
    mr.temperatures_only = lambda *x: None
    try:
        return plain_verify(self, *a)
    finally:
        mr.temperatures_only = saved_t
for b in ((1, 64) if os.environ.get('LOOP') else ()):
    ps = prompts(b)
    saved = eng.spec, eng.scheduler.proposer
    eng.spec = eng.scheduler.proposer = None
    timed(ps, 8)
    full, outs = timed(ps, 64); first, _ = timed(ps, 1)
    res[f"plain_b{b}_ms"] = (full - first) / 63 * 1e3
    answers = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}
    print(b, "answer sample", outs[0].outputs[0].token_ids[:8], ps[0][-1], flush=True)
    eng.spec, _ = saved
    for p, ab in ((1.0, ""), (1.0, "eager_sampler"), (0.8, ""), (0.8, "eager_sampler"), (0.5, "")):
        eng.scheduler.proposer = ToldProposer(llm, answers, 4, p, 151936)
        mr.ModelRunner._verify = plain_verify if not ab else eager_sampled_verify
        timed(ps, 8)
        before = eng.stats().spec
        full, souts = timed(ps, 64); first, _ = timed(ps, 1)
        after = eng.stats().spec
        p = f"{p}{ab}"
        res[f"spec_b{b}_p{p}_ms"] = (full - first) / 63 * 1e3
        res[f"spec_b{b}_p{p}_acc"] = (after.num_accepted_tokens - before.num_accepted_tokens) / max(1, after.num_draft_tokens - before.num_draft_tokens)
        res[f"spec_b{b}_p{p}_verifies"] = after.num_drafts - before.num_drafts
        res[f"spec_b{b}_p{p}_same"] = all(a.outputs[0].token_ids == o.outputs[0].token_ids for a, o in zip(souts, outs))
    print(json.dumps(res), flush=True)

mr.ModelRunner._verify = plain_verify
if os.environ.get('LOOP'):
    (OUT / f"spec_{shape}.json").write_text(json.dumps(res, indent=1)); sys.exit()
# phase timing of verify steps at batch 1, p=1.0
ps = prompts(1)
saved = eng.spec, eng.scheduler.proposer
eng.spec = eng.scheduler.proposer = None
_, outs = timed(ps, 64)
eng.spec = saved[0]
eng.scheduler.proposer = ToldProposer(llm, {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in outs}, 4, 1.0, 151936)
phases = {}
def wrap(obj, name, key):
    f = getattr(obj, name)
    def g(*a, **k):
        torch.cuda.synchronize(); t = time.perf_counter()
        r = f(*a, **k)
        torch.cuda.synchronize(); phases.setdefault(key, []).append(time.perf_counter() - t)
        return r
    setattr(obj, name, g)
wrap(mr.ModelRunner, "_verify", "verify_launch")
wrap(mr.ModelRunner, "_prepare", "prepare")
wrap(sv.VerifiedStep, "result", "verify_result")
wrap(sv, "verify", "rejection")
mr.verify = sv.verify
wrap(type(eng), "step", "engine_step")
runner = eng.executor
wrap(runner.model, "forward", "model_forward")
wrap(runner.model, "compute_logits", "logits")
timed(ps, 64)
phases.clear()
timed(ps, 64)
res["phases_ms"] = {k: [round(sum(v) / len(v) * 1e3, 3), len(v)] for k, v in phases.items()}
print(json.dumps(res["phases_ms"]), flush=True)
(OUT / f"spec_{shape}.json").write_text(json.dumps(res, indent=1))
# unwrap not needed: profile with wrappers gone matters less; profile anyway
from torch.profiler import ProfilerActivity, profile
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    timed(ps, 32)
(OUT / f"prof_{shape}.txt").write_text(
    prof.key_averages().table(sort_by="cpu_time_total", row_limit=45) + "\n\n" +
    prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
print("done")
