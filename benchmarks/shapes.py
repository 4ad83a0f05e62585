"""`python benchmarks/shapes.py ...`: nanoserve.bench.shapes (see its docstring)."""
from nanoserve.bench.shapes import main

if __name__ == "__main__":
    main()
