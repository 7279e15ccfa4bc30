# The commands of the README, and their parts. Every step is idempotent
# and skips its work when its inputs did not change, so a second run is fast.
# For a learner:
#   make lab     the environment (torch's CPU build), then JupyterLab (labs in notebooks/)
#   make student-assignments  the assignments without their solutions, in assignments/
# For instructors and maintainers:
#   make book    environment, assets, then the book (executing every notebook)
#   make test    environment, assets, chromium, the hub's proxy, then every test
#   make test-gpu  the labs on >= 2 GPUs with NCCL (skips, saying why, elsewhere)
#   make test-portable  every chapter's stored outputs under three instruction
#                  sets (before submitting a change to a chapter; ~20 min on 2 cores)
.DEFAULT_GOAL := book
.PHONY: book lab student-assignments test test-gpu test-portable env assets chromium proxy clean distclean

VENV   := .venv
PY     := $(VENV)/bin/python
# -W: warnings are errors; -n: nit-picky about broken references;
# --keep-going: list every warning before failing, not just the first.
JB_FLAGS := -W -n --keep-going
HTML   := _build/html
# Two workers: alone, a chapter's execution or a round trip keeps 1.1 to 1.7
# of 2 cores busy (it waits on process starts and deadlines). A unit of work is
# a file or one chapter's execution, slow units first (tests/conftest.py).
# One worker: make test TEST_WORKERS=
TEST_WORKERS ?= -n 2 --dist loadscope --no-loadscope-reorder

# PyTorch's CPU wheels (pytorch.org/get-started/locally, Compute Platform: CPU);
# on a CUDA machine: make lab TORCH_INDEX=   (PyPI's build). LAB_ARGS: e.g. --no-browser
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
LAB_ARGS ?=
STUDENT_DIR ?= assignments

lab:
	TORCH_INDEX=$(TORCH_INDEX) scripts/setup_env.sh
	$(VENV)/bin/jupyter lab $(LAB_ARGS)

student-assignments: env
	$(PY) scripts/student_assignments.py $(STUDENT_DIR)

book: env assets
	$(VENV)/bin/jupyter-book build . $(JB_FLAGS)
	@echo "book: open file://$(CURDIR)/$(HTML)/index.html"

test: env assets chromium proxy
	$(PY) -m pytest $(TEST_WORKERS)

test-gpu: env
	scripts/test_gpu.sh

# nbval over every chapter natively, then with ATen at no vector extensions and
# with ATen, oneDNN and MKL at AVX2: the last bits another CPU changes (issue 34).
# One chapter: make test-portable NOTEBOOKS=notebooks/10_checkpoints_and_failures.ipynb
test-portable: env
	$(PY) scripts/test_portable.py $(NOTEBOOKS)

env:
	scripts/setup_env.sh

# Third-party JS (plotly.js, MathJax, require.js, the widget embedder) into
# assets/vendor/ at pinned versions; never committed. npm fetches the tarballs.
assets: env
	scripts/apt_ensure.sh npm npm
	$(PY) scripts/fetch_assets.py

chromium:
	scripts/ensure_chromium.sh

# JupyterHub's proxy (configurable-http-proxy, npm, pinned by deploy/proxy/
# package-lock.json) into deploy/proxy/node_modules/ for the hub test; never committed.
proxy: env
	scripts/apt_ensure.sh npm npm
	$(PY) scripts/fetch_proxy.py

# Build outputs and fetched assets; keeps .venv and the npm download cache.
clean:
	rm -rf _build assets/vendor assets/vendor.tmp .pytest_cache deploy/proxy/node_modules

distclean: clean
	rm -rf $(VENV) .cache
