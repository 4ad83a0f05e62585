"""`python benchmarks/serve.py ...`: nanoserve.bench.serve (see its docstring)."""
from nanoserve.bench.serve import main

if __name__ == "__main__":
    main()
