# The example workers, one image each (pick with --target):
#   docker build -f deploy/kubernetes/docker/workers.Dockerfile --target embedder        -t warmgate/embedder:dev .
#   docker build -f deploy/kubernetes/docker/workers.Dockerfile --target cartpole-worker -t warmgate/cartpole-worker:dev .
#   docker build -f deploy/kubernetes/docker/workers.Dockerfile --target charlm-worker   -t warmgate/charlm-worker:dev .
#   docker build -f deploy/kubernetes/docker/workers.Dockerfile --target test-worker     -t warmgate/test-worker:dev .
# Each listens on $PORT (8080 in the pod) and follows the worker contract.
FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release -p warmgate-examples -p warmgate-e2e \
        --bin embedder --bin cartpole-worker --bin charlm-worker --bin test-worker \
 && mkdir /out && cp target/release/embedder target/release/cartpole-worker \
        target/release/charlm-worker target/release/test-worker /out/

FROM debian:bookworm-slim AS base
RUN apt-get update && apt-get install -y --no-install-recommends ca-certificates \
 && rm -rf /var/lib/apt/lists/*
USER 65532:65532
EXPOSE 8080

FROM base AS embedder
COPY --from=build /out/embedder /usr/local/bin/worker
ENTRYPOINT ["/usr/local/bin/worker"]

FROM base AS cartpole-worker
COPY --from=build /out/cartpole-worker /usr/local/bin/worker
ENTRYPOINT ["/usr/local/bin/worker"]

FROM base AS charlm-worker
COPY --from=build /out/charlm-worker /usr/local/bin/worker
ENTRYPOINT ["/usr/local/bin/worker"]

FROM base AS test-worker
COPY --from=build /out/test-worker /usr/local/bin/worker
ENTRYPOINT ["/usr/local/bin/worker"]
