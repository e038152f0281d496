#!/usr/bin/env bash
# Build, locally, the base images the Docker end-to-end test needs. No image
# registry is reachable from these machines, so instead of pulling python,
# pytorch/pytorch and redis we debootstrap a Debian bookworm rootfs and build
# docker/local-base.Dockerfile's targets on it (the torch target takes the
# CPU wheel that lies on this machine). Images are cached: a second run only
# checks that they exist and were built from the Dockerfile as it is now (a
# label holds its hash), so a change to it rebuilds them.
set -euo pipefail

ROOTFS_IMAGE=${ROOTFS_IMAGE:-breakpod-rootfs:bookworm}
TORCH_WHEEL=${TORCH_WHEEL:-$(ls /opt/wheels/torch-2.13.0+cpu-cp311-*.whl 2>/dev/null | head -1)}
CA_BUNDLE=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
here=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

have() { docker image inspect "$1" >/dev/null 2>&1; }
recipe=$(sha256sum "$here/docker/local-base.Dockerfile" | cut -c1-16)
current() {
  [ "$(docker image inspect -f '{{ index .Config.Labels "breakpod.recipe" }}' "$1" 2>/dev/null)" \
    = "$recipe" ]
}

if ! have "$ROOTFS_IMAGE"; then
  command -v debootstrap >/dev/null || { apt-get update -qq && apt-get install -y -qq debootstrap; } >/dev/null
  echo "base-images: debootstrap bookworm -> $ROOTFS_IMAGE"
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    bookworm "$work/rootfs" http://deb.debian.org/debian >/dev/null
  tar -C "$work/rootfs" -c . | docker import - "$ROOTFS_IMAGE" >/dev/null
  rm -rf "$work/rootfs"
fi

mkdir -p "$work/context"
cp "$CA_BUNDLE" "$work/context/ca-certificates.crt"
for target in python torch redis; do
  image="breakpod-$target:local"
  current "$image" && continue
  if [ "$target" = torch ]; then
    [ -f "$TORCH_WHEEL" ] || { echo "base-images: no torch wheel (set TORCH_WHEEL)" >&2; exit 1; }
    cp "$TORCH_WHEEL" "$work/context/"
  fi
  echo "base-images: building $image"
  docker build -q --network host --target "$target" --build-arg ROOTFS="$ROOTFS_IMAGE" \
    --label "breakpod.recipe=$recipe" \
    -t "$image" -f "$here/docker/local-base.Dockerfile" "$work/context" >/dev/null
done
echo "base-images: $ROOTFS_IMAGE and breakpod-{python,torch,redis}:local are ready"
