"""`python benchmarks/latency.py ...`: nanoserve.bench.latency (see its docstring)."""
from nanoserve.bench.latency import main

if __name__ == "__main__":
    main()
