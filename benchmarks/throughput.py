"""`python benchmarks/throughput.py ...`: nanoserve.bench.throughput (see its docstring)."""
from nanoserve.bench.throughput import main

if __name__ == "__main__":
    main()
