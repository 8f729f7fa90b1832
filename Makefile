# Mirrors CI (.ci/run): `make ci` runs what CI runs, after CI's installs.
.PHONY: ci lint test bench fmt

ci: lint test

lint:
	cargo fmt --all -- --check
	cargo clippy --workspace --all-targets -- -D warnings
	cargo clippy -p warmgate-gateway --features otlp --all-targets -- -D warnings

# The README's test command. The end-to-end tests start the real binaries,
# so build them first (the test build reuses every compiled dependency).
test:
	@command -v cargo-nextest >/dev/null || cargo install cargo-nextest --locked
	cargo build --workspace --bins
	cargo nextest run --workspace
	cargo nextest run -p warmgate-gateway --features otlp --lib -E 'test(otlp)'

# Benchmarks (not in CI: they take minutes and need two quiet cores).
bench:
	bash benches/proxy.sh
	bash benches/weights.sh
	bash benches/pools.sh

fmt:
	cargo fmt --all
