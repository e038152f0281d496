# A debug layer on top of any PyTorch training image: breakpod, debugpy and a
# tiny init. Build from the repository root:
#   docker build -f docker/debug.Dockerfile --build-arg BASE_IMAGE=my/train:1.2 -t my/train:1.2-debug .
# The base must have python (with pip) on PATH; PYTHON names it otherwise.
ARG BASE_IMAGE=pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime

FROM ${BASE_IMAGE}
ARG PYTHON=python
COPY agent/ /tmp/breakpod-agent/
# Unpinned debugpy (>=1.8) follows the base image's Python; dumb-init comes as a
# static binary in its wheel, so no distribution package manager is needed.
RUN ${PYTHON} -m pip install --no-cache-dir /tmp/breakpod-agent "debugpy>=1.8" "dumb-init==1.2.5.post1" \
 && rm -rf /tmp/breakpod-agent
# No USER, on purpose: the layer keeps the base image's user. Training images
# often run as root (GPU device nodes, /dev/shm for DataLoader workers, caches
# they write), and the pip install above needs a user that may install (root in
# the default base). breakpod itself needs no privilege and its files are
# world-readable: to run the job as non-root, say so where it runs
# (`docker run --user`, Kubernetes securityContext.runAsUser).
ENV PYTHONBREAKPOINT=breakpod.set_trace \
    PYTHONUNBUFFERED=1 \
    BREAKPOD_PORT=5678
# The remote pdb / debugpy port (BREAKPOD_PORT, plus LOCAL_RANK per rank). It
# binds 127.0.0.1 unless BREAKPOD_HOST says otherwise (see compose.debug.yml).
EXPOSE 5678
# dumb-init as PID 1 forwards SIGTERM/SIGINT to Python, so a parked job still
# stops cleanly on `docker stop` or pod deletion.
ENTRYPOINT ["dumb-init", "--"]
CMD ["python"]
