# DCP front door. `make demo` and `make test` set up .venv themselves.
VENV        := .venv
PY          := $(VENV)/bin/python
REQS        := requirements.txt requirements-dev.txt
STAMP       := $(VENV)/.installed-$(shell cat $(REQS) | cksum | cut -d' ' -f1)
NPROC       ?= 2
# megatron-core 0.19 needs Python 3.12: a working python3.12 on PATH, else pyenv's, else system.
PYTHON312   := $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 \
                 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
                 if $$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1; \
                 then echo $$c; break; fi; done)
export OMP_NUM_THREADS ?= 1
export PYTHONUNBUFFERED := 1

.PHONY: setup demo demo-tp demo-pp demo-moe demo-sft demo-sft-engine data test unit test-compat compat-axis lint format bench compare simulate extend-context \
        clean

setup: $(STAMP)

$(STAMP): $(REQS)
	@if [ -z "$(PYTHON312)" ]; then \
	  echo "error: Python 3.12 not found (megatron-core 0.19 requires it)." >&2; \
	  echo "Install it (e.g. 'pyenv install 3.12' or your distro's python3.12) and re-run." >&2; \
	  exit 1; fi
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	@rm -f $(VENV)/.installed-*
	@touch $@

data: data/stdlib.idx

data/stdlib.idx: $(STAMP)
	$(PY) -m tools.prepare_data --stdlib --out data/stdlib

demo: data
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) -m pretrain.pretrain_gpt \
	  --config pretrain/configs/tiny_cpu.yaml $(ARGS)

# Tensor parallelism on CPU: the demo at TP = 2 on 4 ranks (2 planner ranks of 2, as `make demo`
# has 2 planner ranks of 1), on the same batches; its losses match the demo's up to rounding.
demo-tp: data
	$(VENV)/bin/torchrun --nproc-per-node 4 -m pretrain.pretrain_gpt \
	  --config pretrain/configs/tiny_cpu.yaml name=demo-tp2 parallel.tensor_parallel_size=2 $(ARGS)

demo-pp: data
	$(VENV)/bin/torchrun --nproc-per-node 4 -m pretrain.pretrain_gpt \
	  --config pretrain/configs/tiny_cpu.yaml name=demo-pp2 parallel.pipeline_parallel_size=2 $(ARGS)

# Mixture-of-experts on CPU: the demo model with 4 experts (top-2, sigmoid router balanced by
# its expert bias, moved 0.02 a step: megatron's default 1e-3 is too slow for 40 steps, see
# docs/design.md 'Experts'; expert_load in the step lines) in every layer, expert
# parallelism 2 on 4 ranks (every plan step on whole EP groups: CP >= 2), checkpoints included
# (experts saved by their layer index: they resume at any EP size; docs/design.md, 'Experts').
demo-moe: data
	$(VENV)/bin/torchrun --nproc-per-node 4 -m pretrain.pretrain_gpt \
	  --config pretrain/configs/tiny_cpu.yaml name=demo-moe model.num_experts=4 \
	  model.moe_router_topk=2 model.moe_router_score_function=sigmoid \
	  model.moe_router_expert_bias=true model.moe_router_bias_update_rate=0.02 \
	  parallel.expert_parallel_size=2 $(ARGS)

# Supervised fine-tuning on CPU through DCP's trainer (pretrain/configs/sft_cpu.yaml): chat
# conversations (a generated demo corpus, or ARGS="data.chat.path=your.jsonl"), byte-level
# tokens, loss on the assistant's tokens only, checkpoints and resume as for pretraining.
demo-sft: data/demo_chats.jsonl
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) -m pretrain.pretrain_gpt \
	  --config pretrain/configs/sft_cpu.yaml $(ARGS)

data/demo_chats.jsonl: $(STAMP)
	$(PY) -c "from dcp.data.sft import write_demo_chats; write_demo_chats('$@', num_chats=512)"

# The same in a plain loop through DCPEngine (pretrain/example_sft.py; ARGS="--data your.jsonl").
demo-sft-engine: $(STAMP)
	$(VENV)/bin/torchrun --nproc-per-node $(NPROC) -m pretrain.example_sft $(ARGS)

# Context extension on CPU (pretrain/configs/extend_context_cpu.yaml): a 512-token base model,
# exported to Hugging Face format, imported and continued at 2K then 4K tokens.
CTX_RUN     := $(VENV)/bin/torchrun --nproc-per-node $(NPROC) -m pretrain.pretrain_gpt
extend-context: data
	rm -rf runs/ctx-base runs/ctx-extend-2k runs/ctx-extend-4k
	$(CTX_RUN) --config pretrain/configs/tiny_cpu.yaml name=ctx-base model.max_seq_len=512 \
	  data.indexed.max_doc_len=512 train.steps=30 optim.decay_steps=30 \
	  metrics.wandb_group=extend-context $(ARGS)
	$(PY) -m tools.convert_checkpoint dcp-to-hf runs/ctx-base/checkpoints runs/ctx-base/hf
	$(CTX_RUN) --config pretrain/configs/extend_context_cpu.yaml $(ARGS)
	$(CTX_RUN) --config pretrain/configs/extend_context_cpu.yaml name=ctx-extend-4k \
	  init.from_hf=null init.from_checkpoint=runs/ctx-extend-2k/checkpoints \
	  data.indexed.max_doc_len=4096 $(ARGS)
	$(PY) -m tools.compare_runs runs/ctx-base runs/ctx-extend-2k runs/ctx-extend-4k \
	  --out runs/extend-context-report

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint Dockerfile
	$(VENV)/bin/shellcheck docker/*.sh docker/*.sbatch .ci/run tests/e2e/install_slurm.sh

format: setup
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

test: setup lint
	@bash tests/e2e/install_slurm.sh
	$(VENV)/bin/pytest -q tests

unit: setup
	$(VENV)/bin/pytest -q tests/unit

# Both ends of the supported ranges (pyproject.toml), each with every other pin in a venv of its
# own: `oldest` (requirements-compat.txt: the oldest torch and megatron-core, .venv-compat) and
# `newest` (requirements-newest.txt: the newest torch, .venv-newest; requirements.txt already has
# the newest megatron-core). Each runs the unit tests, the distributed parity tests, and one short
# run of each entry point under torchrun, DCP's trainer and Megatron-LM's loop with --dcp
# (docs/testing.md, "Supported versions"). `make test-compat COMPAT=newest` runs one end.
COMPAT      ?= oldest newest
AXIS        ?= oldest
AXIS_PINS   := $(if $(filter newest,$(AXIS)),requirements-newest.txt,requirements-compat.txt)
COMPAT_VENV := $(if $(filter newest,$(AXIS)),.venv-newest,.venv-compat)
COMPAT_PY   := $(COMPAT_VENV)/bin/python
COMPAT_REQS := $(AXIS_PINS) $(REQS)
COMPAT_STAMP := $(COMPAT_VENV)/.installed-$(shell cat $(COMPAT_REQS) | cksum | cut -d' ' -f1)
COMPAT_TESTS ?= tests/unit tests/distributed/test_attention.py \
                tests/distributed/test_runtime_parity.py tests/distributed/test_tensor_parallel.py \
                tests/distributed/test_hf_parity.py \
                tests/e2e/test_pretrain.py::test_run_writes_metrics_config_and_wandb \
                tests/e2e/test_collective_devices.py::test_megatron_loop_collectives_use_the_run_device

$(COMPAT_STAMP): $(COMPAT_REQS)
	@if [ -z "$(PYTHON312)" ]; then \
	  echo "error: Python 3.12 not found (megatron-core 0.19 requires it)." >&2; exit 1; fi
	@test -x $(COMPAT_PY) || $(PYTHON312) -m venv $(COMPAT_VENV)
	$(COMPAT_PY) -m pip install -q --upgrade pip
	names=$$(sed -n 's/^\([A-Za-z0-9_.-]*\)==.*/\1/p' $(AXIS_PINS) | paste -sd'|'); \
	  grep -v -E "^($$names)==" requirements.txt > $(COMPAT_VENV)/requirements-rest.txt
	$(COMPAT_PY) -m pip install -q -r $(AXIS_PINS) \
	  -r $(COMPAT_VENV)/requirements-rest.txt -r requirements-dev.txt
	@rm -f $(COMPAT_VENV)/.installed-*
	@touch $@

test-compat:
	@for axis in $(COMPAT); do $(MAKE) --no-print-directory compat-axis AXIS=$$axis || exit 1; done

compat-axis: $(COMPAT_STAMP)
	$(COMPAT_PY) -c 'import importlib.metadata as m; \
	  print("$(AXIS): torch", m.version("torch"), "megatron-core", m.version("megatron-core"))'
	$(COMPAT_VENV)/bin/pytest -q $(COMPAT_TESTS)

simulate: setup
	$(PY) -m tools.simulate

bench: data
	$(PY) -m tools.bench_e2e

# Convergence on the demo corpus: DCP, static (one CP size and recompute level for the run) and
# Megatron Hybrid-CP's scheduler train the same batches for COMPARE_STEPS steps each (fixed
# calibration, so the three see the same cost model), then tools.compare_runs draws loss against
# step, training time and tokens, with the time each run takes to reach a few loss levels. On the
# demo's corpus as docs/results.md measured it: 4,096-token chunks (the demo's were that then).
COMPARE_STEPS ?= 150
compare: data
	rm -rf runs/compare-dcp runs/compare-static runs/compare-megatron runs/compare-report
	for planner in dcp static megatron; do \
	  $(VENV)/bin/torchrun --nproc-per-node $(NPROC) -m pretrain.pretrain_gpt \
	    --config pretrain/configs/tiny_cpu.yaml name=compare-$$planner \
	    data.indexed.max_doc_len=4096 \
	    planning.planner=$$planner planning.calibration=fixed train.steps=$(COMPARE_STEPS) \
	    optim.decay_steps=$(COMPARE_STEPS) checkpoint.interval_steps=$(COMPARE_STEPS) \
	    metrics.wandb_group=compare $(ARGS) || exit 1; \
	done
	$(PY) -m tools.compare_runs runs/compare-dcp runs/compare-static runs/compare-megatron \
	  --out runs/compare-report

clean:
	rm -rf runs .pytest_cache .ruff_cache
