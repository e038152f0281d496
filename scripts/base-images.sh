#!/usr/bin/env bash
# Build, locally, the base images the Docker end-to-end test needs. No image
# registry is reachable from these machines, so instead of pulling
# pytorch/pytorch we debootstrap a Debian bookworm rootfs (Python 3.11) and
# add the CPU torch wheel that lies on this machine. Both images are cached:
# a second run only checks that they exist.
set -euo pipefail

ROOTFS_IMAGE=${ROOTFS_IMAGE:-breakpod-rootfs:bookworm}
TORCH_IMAGE=${TORCH_IMAGE:-breakpod-torch-cpu:local}
TORCH_WHEEL=${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1)}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
here=$(cd "$(dirname "$0")/.." && pwd)

have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have "$ROOTFS_IMAGE"; then
  command -v debootstrap >/dev/null || apt-get install -y -q debootstrap >/dev/null
  rootfs=$(mktemp -d)
  trap 'rm -rf "$rootfs"' EXIT
  echo "base-images: debootstrap bookworm -> $ROOTFS_IMAGE"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$rootfs" http://deb.debian.org/debian >/dev/null
  tar -C "$rootfs" -c . | docker import - "$ROOTFS_IMAGE" >/dev/null
fi

if ! have "$TORCH_IMAGE"; then
  [ -f "$TORCH_WHEEL" ] || { echo "base-images: no torch wheel (set TORCH_WHEEL)" >&2; exit 1; }
  context=$(mktemp -d)
  trap 'rm -rf "$context"' EXIT
  cp "$TORCH_WHEEL" "$context/"
  cp "$CA_BUNDLE" "$context/ca-certificates.crt"
  echo "base-images: $ROOTFS_IMAGE + $(basename "$TORCH_WHEEL") -> $TORCH_IMAGE"
  docker build -q --network host -t "$TORCH_IMAGE" --build-arg ROOTFS="$ROOTFS_IMAGE" \
    -f "$here/docker/torch-cpu.Dockerfile" "$context" >/dev/null
fi
echo "base-images: $ROOTFS_IMAGE and $TORCH_IMAGE are ready"
