# Foreshock: the two README commands are `make demo` and `make test`; both create or reuse .venv.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench proto lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,torch,kubernetes,ray]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/foreshock demo

# Two workers (pytest-xdist): much of the suite waits on real services, not the CPU. Each test file
# stays whole on one worker, so a module's services (the Slurm cluster, the Ray head, the demo run) and
# its trained fixtures start once per run, never two copies at a time.
test: $(STAMP)
	bash tests/setup.sh
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: $(STAMP)
	$(PY) -m benchmarks

proto: $(STAMP)
	$(PY) -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/foreshock/v1/*.proto

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
