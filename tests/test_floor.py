"""The benchmarks' floors (bench/floor.py): bytes and FLOPs of steps, batch-1 decode and a
workload, against numbers counted by hand, sliding windows included."""
from nanoserve.bench.floor import self_check


def test_floor_arithmetic_matches_hand_counts():
    self_check()
