#!/usr/bin/env bash
# make e2e-docker: the compose stack with the debug overlay on a real Docker
# engine. Starts dockerd when none runs (and can be started), builds the local
# base images, then runs tests/e2e. Without an engine it prints why and skips.
# Compose is `docker compose` (v2) when the docker CLI has it, else Debian's
# `docker-compose` (v1); the tests pick the same one (tests/e2e/compose_cli.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}

engine_up() { docker info >/dev/null 2>&1; }
have_compose() { docker compose version >/dev/null 2>&1 || command -v docker-compose >/dev/null; }

if ! have_compose || { ! engine_up && ! command -v dockerd >/dev/null; }; then
  { apt-get update -qq && apt-get install -y -qq docker.io docker-compose debootstrap; } >/dev/null 2>&1 || true
fi
if ! engine_up; then
  if command -v dockerd >/dev/null; then
    echo "e2e-docker: starting dockerd (log: /tmp/breakpod-dockerd.log)"
    nohup dockerd >/tmp/breakpod-dockerd.log 2>&1 &
    for _ in $(seq 60); do engine_up && break; sleep 0.5; done
  fi
fi
if ! engine_up; then
  echo "e2e-docker: SKIPPED: no Docker engine could be started here"
  exit 0
fi
if ! have_compose; then
  echo "e2e-docker: SKIPPED: neither docker compose nor docker-compose could be installed here"
  exit 0
fi

started=$(date +%s)
scripts/base-images.sh
command -v busybox >/dev/null || apt-get install -y -qq busybox-static >/dev/null 2>&1 || true
"$PY" -m pytest -m docker tests/e2e tests/broker/test_docker_watch.py -p no:cacheprovider -q -s
echo "e2e-docker: passed in $(( $(date +%s) - started )) s"
