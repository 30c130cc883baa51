# The README's two commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.tokenmill-installed

.PHONY: install run test bench clean redis-server cross-tools web-browser

install: $(STAMP)

# torch is pinned first: an unpinned torch would pull a multi-GB CUDA build. The install
# compiles the native kernels (setup.py) against that torch, so it runs without build
# isolation (which would fetch a torch of its own). Kernel sources edited since: the
# next install rebuilds them (ninja: only what changed), and until then the engine
# compiles the edited ones at run time.
KERNEL_SOURCES := $(wildcard tokenmill/kernels/*.cpp tokenmill/kernels/*.h tokenmill/kernels/*/*.h) \
	tokenmill/kernels/levels.py
$(STAMP): pyproject.toml setup.py $(KERNEL_SOURCES)
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0 'setuptools>=70.1' ninja
	@echo "installing tokenmill and compiling its native CPU kernels (every CPU capability level: a few minutes on 2 cores) ..."
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $(STAMP)

# The main job: the OpenAI-compatible server on the built-in demo model
# (created on first use), on 127.0.0.1:8000.
run: install
	$(VENV)/bin/tokenmill serve

# The external-KV tests run a real redis-server (Debian's package), installed here
# when missing; the tests start their own on a free port and stop it.
# The server suite runs twice: once more with every server's engine core inside the
# server's process (TOKENMILL_ENGINE_PROCESS=0; the default is a process of its own:
# the live servers and the in-process app read it).
SERVER_TESTS := $(wildcard tests/test_server*.py) tests/test_web_ui_server.py
test: install redis-server cross-tools web-browser
	$(PY) -m pytest -q tests
	TOKENMILL_ENGINE_PROCESS=0 $(PY) -m pytest -q $(SERVER_TESTS)

redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server; }

# The kernels' aarch64 checks (tests/unit/test_vec_header.py) cross-compile with
# Debian's g++-aarch64-linux-gnu and run NEON code under qemu-user.
cross-tools:
	@{ [ "$$(uname -m)" != x86_64 ] || { command -v aarch64-linux-gnu-g++ && command -v qemu-aarch64; } >/dev/null 2>&1; } || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq g++-aarch64-linux-gnu qemu-user; }

# The web page's tests (tests/test_web_ui.py) drive Debian's chromium through its
# chromedriver with selenium: nothing downloads a browser.
web-browser:
	@{ command -v chromium && command -v chromedriver; } >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver; }

bench: install
	$(VENV)/bin/tokenmill bench throughput

clean:
	rm -rf $(VENV) *.egg-info build tokenmill/kernels/_C_*
