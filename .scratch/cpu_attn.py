import time, torch, sys
from nanoserve.attention.metadata import AttentionMetadata
from nanoserve.attention.torch_backend import paged_attention_reference
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
H, Hkv, D, bs = 9, 3, 64, 16
def case(q_lens, seq_lens):
    g = torch.Generator().manual_seed(0)
    nblk = sum((s + bs - 1) // bs for s in seq_lens) + 1
    k = torch.randn(nblk, bs, Hkv, D, generator=g); v = torch.randn_like(k)
    perm = torch.randperm(nblk, generator=g)
    maxb = max((s + bs - 1) // bs for s in seq_lens)
    tables = torch.zeros(len(seq_lens), maxb, dtype=torch.int32); used = 0
    for i, s in enumerate(seq_lens):
        n = (s + bs - 1) // bs; tables[i, :n] = perm[used:used + n]; used += n
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    meta = AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.int32), torch.zeros(sum(q_lens), dtype=torch.int64), tables, max(q_lens), max(seq_lens))
    q = torch.randn(sum(q_lens), H, D, generator=g)
    return q, k, v, meta
for name, ql, sl in [("32 decodes @600", [1]*32, [600]*32), ("31 decodes @600 + 512 prefill", [1]*31 + [512], [600]*31 + [512]),
                     ("32 decodes @100..3000", [1]*32, [100 + 93*i for i in range(32)]), ("1 prefill 2048", [2048], [2048])]:
    q, k, v, meta = case(ql, sl)
    paged_attention_reference(q, k, v, meta, 0.125)
    t = time.perf_counter(); n = 5
    for _ in range(n): out = paged_attention_reference(q, k, v, meta, 0.125)
    print(f"{name}: {(time.perf_counter() - t) / n * 1e3:.2f} ms/layer")
