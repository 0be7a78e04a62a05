PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: install test lint demo

# torch first. With a GPU (nvidia-smi lists one): the default index's torch, CUDA's build on Linux. Without one: the CPU
# build from PyTorch's CPU index, since the default index's Linux wheel pulls several GB of CUDA packages; where that
# index cannot be reached (a machine that reaches only package registries), the first try fails within seconds and
# torch comes from the default index.
install:
	if nvidia-smi -L >/dev/null 2>&1; then $(PYTHON) -m pip install torch; \
	else $(PYTHON) -m pip install --timeout 10 --retries 0 --index-url $(TORCH_CPU_INDEX) torch==$(TORCH_VERSION) \
	|| { echo "make install: no torch $(TORCH_VERSION) from $(TORCH_CPU_INDEX); trying the default index" >&2; \
	$(PYTHON) -m pip install torch==$(TORCH_VERSION); }; fi
	$(PYTHON) -m pip install -e ".[dev]"

test:
	$(PYTHON) -m pytest -n 2 -q

lint:
	$(PYTHON) -m ruff check hf_vaswani tests scripts

demo:
	vaswani demo --output-dir demo_output
