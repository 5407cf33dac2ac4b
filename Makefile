# The README's commands: make demo, make test. Everything installs itself.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
STAMP   := $(VENV)/.installed
APT_PKGS := openssh-server openssh-client rsync pdsh iproute2 procps iptables chromium chromium-driver

# Python may cache bytecode here even where the shell says not to: pytest keeps its
# rewritten test modules as .pyc, and every `orch` a test starts loads compiled modules
# (both in __pycache__/, which git ignores). Without it `make test-fast` is 10 s longer.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: install lock system-deps test test-scale test-fast test-stress check docs demo bench gpu-check clean

install: $(STAMP)

# Exactly the locked set (requirements.lock, made by `make lock`): a new release upstream
# changes nothing here until the lock is refreshed on purpose. tools/check_lock.py proves it.
$(STAMP): pyproject.toml requirements.lock
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q -c requirements.lock pip setuptools
	$(VPY) -m pip install -q -c requirements.lock -e '.[worker,dev,curves]'
	$(VPY) tools/check_lock.py requirements.lock
	touch $(STAMP)

# Refresh the lock on purpose: pip-tools resolves pyproject.toml's dependencies and extras,
# with the hand-set pins of constraints.txt (lock.in), to the newest releases that fit.
# The package's own ranges in pyproject.toml stay loose for users who pip install it.
LOCKVENV := .venv-lock
lock:
	test -x $(LOCKVENV)/bin/pip-compile || { $(PY) -m venv $(LOCKVENV) && $(LOCKVENV)/bin/pip install -q pip-tools==7.6.2; }
	$(LOCKVENV)/bin/pip-compile -q --extra worker --extra dev --extra curves --strip-extras --allow-unsafe \
	  --no-emit-index-url --no-emit-find-links --annotation-style line \
	  -o requirements.lock pyproject.toml lock.in

# sshd, rsync and pdsh are what the tests' fake cluster and the benchmarks' baselines use;
# chromium and chromium-driver, the browser the dashboard's test drives headless.
system-deps:
	@missing=""; for p in $(APT_PKGS); do dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing:$$missing"; \
	  SUDO=""; [ "$$(id -u)" = 0 ] || SUDO=sudo; \
	  $$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq $$missing >/dev/null; \
	fi

# The whole suite in TEST_WORKERS pytest-xdist workers. Most of its time is real waiting
# (sshd logins, jobs, timeouts), which a third worker overlaps on 2 cores. Each worker has
# fake hosts, ports and temp folders of its own (tests/sshd_cluster.py); a module with a
# fixture of its own (its own sshd cluster, namespaces) is one xdist_group that one worker
# runs, the costly tests first (tests/conftest.py). TEST_WORKERS=0 runs it serially;
# TEST_ARGS adds pytest options. Times: docs/development.md; the 40 slowest tests are
# listed at the end of each run (where the next cut of the suite's time is).
TEST_WORKERS ?= 3
test: install system-deps
	$(VPY) -m pytest -n $(TEST_WORKERS) --dist loadgroup --no-loadscope-reorder \
	  --durations=40 $(TEST_ARGS)

# The scale tier: orch at 300 hosts, one sshd each (tests/test_scale.py; `up`, `status`,
# `stop`, under a login session's 1,024 open files). Alone, since its 300 hosts share the
# machine's cores; CI runs it after `make test` (.ci/run). Time: docs/development.md.
test-scale: install system-deps
	$(VPY) -m pytest -m scale --durations=10 tests/test_scale.py $(TEST_ARGS)

# The unit tests only: no sshd, no training, a quarter of the fuzz documents; in 4
# pytest-xdist workers even on 2 cores: their time is mostly each worker's start (torch's
# import), the fuzz and the fake agents' real waits, which a third and fourth worker
# overlap with the CPU work (2 cores: 25 s with 4 workers, 28 s with 2; docs/development.md).
test-fast: install
	$(VPY) -m pytest -m "not ssh and not slow" --hypothesis-profile=fast \
	  -n 4 --dist worksteal

# The sshd and timing-sensitive tiers (pytest -m "ssh or timing"; the markers are set in
# tests/conftest.py) beside a plain CPU burner that keeps one core busy: a loop in another
# process, ended by its pid when pytest ends (or is interrupted). A test that holds only on a
# quiet machine fails here. More pytest options: STRESS_ARGS="...". Last result: docs/development.md.
test-stress: install system-deps
	@$(PY) -c 'while True: pass' & burner=$$!; \
	trap 'kill $$burner 2>/dev/null' EXIT; trap 'exit 130' INT TERM; \
	echo "test-stress: CPU burner pid $$burner; load average $$(cut -d' ' -f1-3 /proc/loadavg)"; \
	$(VPY) -m pytest -m "ssh or timing" $(STRESS_ARGS); rc=$$?; \
	echo "test-stress: load average at the end $$(cut -d' ' -f1-3 /proc/loadavg)"; exit $$rc

# Lint, types and layers: ruff on every Python folder, mypy as configured in pyproject.toml
# (strict on orchestrator/), import-linter's contracts ([tool.importlinter]: the layers,
# the agent alone, no circles, commands independent). All run, so one call shows every finding.
check: install
	@rc=0; \
	$(VPY) -m ruff check orchestrator worker tests bench tools || rc=1; \
	$(VPY) -m mypy || rc=1; \
	$(VENV)/bin/lint-imports --no-cache || rc=1; \
	exit $$rc

# The documentation site (docs/, mkdocs.yml) into site/: a page left out of nav, a broken
# link or anchor is an error (mkdocs.yml's validation settings with --strict).
docs: install
	$(VENV)/bin/mkdocs build --strict

demo: install
	$(VPY) -m worker.demo_data --out data/demo --seed 0
	$(VENV)/bin/orch split-data -c cluster.yaml
	$(VENV)/bin/orch up cluster.yaml

# BENCH_ARGS=--scale adds bench/scale.py (16, 64, 128 fake hosts; about 13 minutes)
# BENCH_ARGS=--recovery adds bench/recovery.py (restarts after faults, real torch; about 4 minutes)
bench: install system-deps
	$(VPY) bench/run_all.py $(BENCH_ARGS)

# The GPU proof: pytest -m gpu and bench/gpu.py, report in bench/out/gpu.md. It installs
# nothing (a GPU machine may be offline): it uses .venv when its torch sees CUDA, else
# python3. Without CUDA it says so and exits 0. Extra bench options: GPU_BENCH_ARGS="...".
gpu-check:
	$(PY) bench/gpu_check.py --bench-args "$(GPU_BENCH_ARGS)"

clean:
	rm -rf $(VENV) $(LOCKVENV) .orch build *.egg-info
