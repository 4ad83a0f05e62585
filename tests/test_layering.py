"""House rules that imports can break: engine/ knows no torch; the server imports lazily."""
from __future__ import annotations

import subprocess
import sys


def _modules_after(imports: str) -> set[str]:
    code = f"import sys; {imports}; print(' '.join(sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_engine_control_plane_imports_no_torch():
    loaded = _modules_after("import nanoserve.engine.llm_engine, nanoserve.engine.scheduler, "
                            "nanoserve.engine.block_manager, nanoserve.engine.detokenizer")
    assert "torch" not in loaded


def test_importing_nanoserve_loads_no_model_stack():
    loaded = _modules_after("import nanoserve; from nanoserve import SamplingParams")
    assert not {"torch", "transformers", "fastapi"} & loaded
