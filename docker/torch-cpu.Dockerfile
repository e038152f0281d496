# A local stand-in for a public PyTorch runtime image, for machines that cannot
# reach an image registry (scripts/base-images.sh builds it). Python 3.11 in a
# venv on PATH, with the CPU torch wheel from the build context.
ARG ROOTFS=breakpod-rootfs:bookworm
FROM ${ROOTFS}

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/breakpod-build-ca.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1
COPY ca-certificates.crt /etc/ssl/certs/breakpod-build-ca.crt
COPY torch-*.whl /tmp/wheels/
RUN python3 -m venv "$VIRTUAL_ENV" \
 && pip install --no-cache-dir /tmp/wheels/torch-*.whl numpy \
 && rm -rf /tmp/wheels
