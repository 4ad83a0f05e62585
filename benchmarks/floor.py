"""`python benchmarks/floor.py ...`: nanoserve.bench.floor (see its docstring)."""
from nanoserve.bench.floor import main

if __name__ == "__main__":
    main()
