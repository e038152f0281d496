#!/usr/bin/env bash
# End to end on a real Kubernetes API: a kind cluster, the images built by
# scripts/images.sh (the debug layer on a CPU torch base) and loaded into it,
# then every check of scripts/e2e-cluster.sh against that cluster. Needs
# docker, kind, kubectl and network access for the images; NOT run in CI (no
# Kubernetes API can run there). Usage: make e2e-kind   (KEEP=1 keeps the cluster).
set -euo pipefail
cd "$(dirname "$0")/.."

CLUSTER=${CLUSTER:-breakpod-e2e}
PY=${PY:-.venv/bin/python}
WORK=$(mktemp -d)

for tool in docker kind kubectl; do
  command -v "$tool" >/dev/null || { echo "e2e-kind: skipped: $tool is not installed"; rm -rf "$WORK"; exit 0; }
done

cleanup() {
  [[ "${KEEP:-0}" == 1 ]] || kind delete cluster --name "$CLUSTER" >/dev/null 2>&1 || true
  rm -rf "$WORK"
}
trap cleanup EXIT
step() { printf '\n== %s\n' "$*"; }

step "images"
cat > "$WORK/base.Dockerfile" <<'DOCKERFILE'
FROM python:3.11-slim-bookworm
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu
DOCKERFILE
docker build -q -t breakpod-train-base:dev -f "$WORK/base.Dockerfile" "$WORK" >/dev/null
VERSION=dev TRAIN_BASE=breakpod-train-base:dev scripts/images.sh

step "cluster"
kind create cluster --name "$CLUSTER" --kubeconfig "$WORK/kubeconfig" --wait 120s
kind load docker-image --name "$CLUSTER" breakpod-broker:dev breakpod-debug:dev

# kind pulls Redis itself: by REDIS_DIGEST when given, else by tag
allow_tag=1
[[ -n "${REDIS_DIGEST:-}" ]] && allow_tag=0
KUBECONFIG="$WORK/kubeconfig" IMAGE_REPOSITORY=breakpod-broker IMAGE_TAG=dev \
  TRAIN_IMAGE=breakpod-debug:dev PULL_POLICY=Never REDIS_ALLOW_TAG="$allow_tag" \
  REDIS_DIGEST="${REDIS_DIGEST:-}" PY="$PY" KEEP="${KEEP:-0}" scripts/e2e-cluster.sh
