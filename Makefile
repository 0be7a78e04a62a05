PYTHON ?= python3

.PHONY: install test lint demo

# CPU build of torch where no GPU is present: an unpinned torch pulls several GB of CUDA packages.
install:
	if command -v nvidia-smi >/dev/null 2>&1; then $(PYTHON) -m pip install torch; \
	else $(PYTHON) -m pip install torch==2.13.0; fi
	$(PYTHON) -m pip install -e ".[dev]"

test:
	$(PYTHON) -m pytest -n 2 -q

lint:
	$(PYTHON) -m ruff check hf_vaswani tests scripts

demo:
	vaswani demo --output-dir demo_output
