# Two commands do all setup on a fresh machine (see README.md):
#   make demo   - builds the ORTModule environment and runs the demo training run
#   make test   - builds both environments and runs the whole test suite in each (CI runs this: .ci/run)
# and one is the fast tier a developer runs before each commit (a few minutes, both environments):
#   make check  - the suite without the slow, distributed, install and examples tests, a few hypothesis examples per
#                 property, and a small sample through Triton's interpreter
# Environments live in ~/.cache/ort-optim/envs (override with ORT_OPTIM_CACHE), keyed by the lock files' hash, shared
# by every clone; .venv and .venv-latest are this clone's own small environments layered on them (tools/make_env.sh).
SHELL := /bin/bash
export PYTHONPATH := $(CURDIR)
PYTEST_ARGS ?=

.PHONY: setup setup-ort setup-latest demo check check-ort check-latest test test-ort test-latest test-triton \
	test-triton-spec test-triton-lowbit aot-check bench clean

setup: setup-ort setup-latest

# Quiet: make_env.sh prints a line per stage (tool output goes to a log under the environment cache) and the build
# one line, so the recipes themselves are not echoed.
setup-ort:
	@tools/make_env.sh ort-stack
	@.venv/bin/python -m ort_optim.build

setup-latest:
	@tools/make_env.sh latest
	@.venv-latest/bin/python -m ort_optim.build

demo: setup-ort
	.venv/bin/python guides/examples/gpt.py

# The jobs run at once, each test process on one intra-op thread: on 2 cores that is faster than one job after the
# other with two threads each (a second thread waiting for a busy core makes small tensor ops many times slower).
# test-triton is three jobs (two halves of the interpreted suite and the ahead-of-time check), so that both cores stay
# busy until the end instead of one long job finishing alone. Each job's output is printed when it ends, whole.
PARALLEL := OMP_NUM_THREADS=1 $(MAKE) --no-print-directory -j5 --output-sync=target
test: setup
	$(PARALLEL) test-ort test-latest test-triton

test-ort:
	.venv/bin/python -m pytest -q $(PYTEST_ARGS)

test-latest:
	.venv-latest/bin/python -m pytest -q $(PYTEST_ARGS)

# The fast tier: no setup (run `make setup` once), both environments at once, the marked kinds left out (markers in
# pyproject.toml), CHECK_FUZZ examples per hypothesis property (ORT_OPTIM_FUZZ_EXAMPLES, tests/conftest.py), and the
# Triton interpreter on the sample of kernel cases that TRITON_CHECK selects.
CHECK_MARKERS := not slow and not distributed and not install and not examples
CHECK_FUZZ ?= 10
TRITON_CHECK := (matches_reference and 2-True) or canary or block_sizes or found_inf or errors_name or grad_stats_matches
check:
	ORT_OPTIM_FUZZ_EXAMPLES=$(CHECK_FUZZ) $(PARALLEL) check-ort check-latest

check-ort:
	.venv/bin/python -m pytest -q -m "$(CHECK_MARKERS)" --ignore=tests/triton_backend $(PYTEST_ARGS)

check-latest:
	.venv-latest/bin/python -m pytest -q -m "$(CHECK_MARKERS)" --ignore=tests/triton_backend $(PYTEST_ARGS)
	.venv-latest/bin/python -m pytest -q -m "$(CHECK_MARKERS)" -k "$(TRITON_CHECK)" tests/triton_backend $(PYTEST_ARGS)

# The FusedAdam spec suites again, through the Triton kernels on CPU tensors (Triton's interpreter), minus the slow
# and distributed tests (quality runs and multi-process runs take tens of minutes in the interpreter) and the
# long parity runs, which take over 15 minutes in the interpreter (tests/triton_backend/test_triton.py covers their
# math bit for bit); then every kernel variant compiled ahead of time for sm_80 and sm_90 and its PTX checked
# (tools/aot_compile.py; Triton's own cache makes a warm run quick).
TRITON_MARKERS := not no_interpreter and not slow and not distributed
TRITON_SUBSET := not 200_steps and not native_op_and_fallback and not adamw_torch_mode
TRITON_PYTEST := ORT_OPTIM_BACKEND=triton TRITON_INTERPRET=1 .venv-latest/bin/python -m pytest -q -m "$(TRITON_MARKERS)" \
	-k "$(TRITON_SUBSET)"
test-triton: test-triton-spec test-triton-lowbit aot-check

test-triton-spec:
	$(TRITON_PYTEST) tests/fused_adam/test_update_rule.py tests/fused_adam/test_mixed_precision.py \
		tests/fused_adam/test_checkpoints.py tests/fused_adam/test_scaling.py $(PYTEST_ARGS)

test-triton-lowbit:
	$(TRITON_PYTEST) tests/fused_adam/test_low_bit.py $(PYTEST_ARGS)

aot-check:
	.venv-latest/bin/python tools/aot_compile.py --check

# The ORTModule stack times the single-process sections (DeepSpeed's CPU Adam is there); the newest torch the
# sections that need it: FSDP2 (torch >= 2.6) and the low-bit baselines (torchao, bitsandbytes).
BENCH_SECTIONS := fp32,mixed,mixed_limit,states,fp16_optimizer,overhead,validation,step_in_backward
BENCH_LATEST_SECTIONS := distributed,lowbit,lowbit_limit,lowbit_memory
bench: setup
	.venv/bin/python -m ort_optim.bench --sections $(BENCH_SECTIONS) $(BENCH_ARGS)
	.venv-latest/bin/python -m ort_optim.bench --sections $(BENCH_LATEST_SECTIONS) --out results/bench-latest.json \
		$(BENCH_ARGS)

clean:
	rm -rf .venv .venv-latest
	rm -rf results .pytest_cache
