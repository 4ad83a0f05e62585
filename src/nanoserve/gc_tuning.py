"""Keep the garbage collector off what start-up loaded."""
from __future__ import annotations

import atexit
import gc


def freeze_startup_heap() -> None:
    """Move every object alive now (modules, model, tokenizer) out of the GC's generations:
    they live as long as the engine, and full collections walking them again would take most
    of a step's Python time. Engine objects are freed by reference counting, so none leaks."""
    gc.collect()
    gc.freeze()
    # Thawed at exit so shutdown finalises them (native bindings report the rest as leaks).
    atexit.unregister(gc.unfreeze)
    atexit.register(gc.unfreeze)
