#!/usr/bin/env bash
# Build and tag, locally, the two images a cluster install needs:
#   ${REGISTRY}/breakpod-broker:VERSION   the broker and the webhook (docker/broker.Dockerfile)
#   ${REGISTRY}/breakpod-debug:VERSION    the debug layer on a training base (docker/debug.Dockerfile)
# VERSION is the chart's appVersion unless given. No public registry holds
# them: push both where your nodes pull from, then set the chart's
# image.repository (docs/deployment.md). LOCAL=1 builds on the local base
# images of scripts/base-images.sh, for machines that reach no image registry.
set -euo pipefail
cd "$(dirname "$0")/.."

command -v docker >/dev/null || { echo "images: docker is not installed" >&2; exit 1; }
VERSION=${VERSION:-$(sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$/\1/p' helm/breakpod/Chart.yaml)}
PREFIX=${REGISTRY:+${REGISTRY%/}/}
BROKER_BASE=${BROKER_BASE:-python:3.11-slim-bookworm}
TRAIN_BASE=${TRAIN_BASE:-pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime}
network=()
if [[ "${LOCAL:-0}" == 1 ]]; then
  scripts/base-images.sh
  BROKER_BASE=breakpod-python:local TRAIN_BASE=breakpod-torch:local network=(--network host)
fi

broker="${PREFIX}breakpod-broker:$VERSION"
debug="${PREFIX}breakpod-debug:$VERSION"
docker build -q "${network[@]}" --build-arg PYTHON_IMAGE="$BROKER_BASE" \
  -t "$broker" -f docker/broker.Dockerfile . >/dev/null
docker build -q "${network[@]}" --build-arg BASE_IMAGE="$TRAIN_BASE" \
  -t "$debug" -f docker/debug.Dockerfile . >/dev/null
echo "images: built $broker and $debug"
echo "images: push them (docker push $broker; docker push $debug), then"
echo "        helm install ... --set image.repository=${PREFIX}breakpod-broker --set image.tag=$VERSION"
