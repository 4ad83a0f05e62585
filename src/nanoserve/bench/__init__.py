"""`nanoserve bench`: the maintained benchmarks (throughput, latency, serve), vLLM's names and
definitions, one JSON line per result; ``--plot out.png`` draws them (matplotlib)."""
