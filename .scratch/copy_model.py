import sys, torch
from pathlib import Path
from nanoserve.bench.shapes import make_model_dir
from nanoserve import LLM, SamplingParams
d = make_model_dir(sys.argv[1], Path("/tmp/cm")/sys.argv[1])
llm = LLM(str(d), load_format="dummy", device="cpu", max_model_len=512)
m = llm.engine.executor.model
print(type(m))
with torch.no_grad():
    for name, p in m.named_parameters():
        if "o_proj" in name or "down_proj" in name:
            p.zero_()
    print([n for n,_ in m.named_parameters()][:12])
out = llm.generate([[5, 17, 123, 99]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
print(out[0].outputs[0].token_ids)
