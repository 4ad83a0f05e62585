"""Keep the garbage collector off what start-up loaded."""
from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, model, tokenizer) out of the GC's generations.

    They live as long as the engine, yet each full collection would walk all of them again:
    with torch and transformers loaded that is most of a serving step's Python time (2.25 ->
    0.78 ms of engine bookkeeping per step at 256 running requests).
    The engine's objects are freed by reference counting, so nothing frozen here leaks when an
    engine is dropped.
    """
    gc.collect()
    gc.freeze()
    # Thawed at exit, so interpreter shutdown finalises them as usual (native bindings such
    # as Triton's report what is never finalised as leaks).
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
