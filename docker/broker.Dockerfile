# The breakpod broker: FastAPI + uvicorn, Redis-backed (embedded redis-server
# when BREAKPOD_REDIS_URL is unset). Build from the repository root:
#   docker build -f docker/broker.Dockerfile -t breakpod-broker:dev .
# PYTHON_IMAGE may be any Debian-like image with python3 and its venv module.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
COPY agent/ agent/
COPY broker/ broker/
# One self-contained virtual environment, copied whole into the runtime stage.
RUN python3 -m venv /opt/breakpod \
 && /opt/breakpod/bin/pip install --no-cache-dir ./agent ./broker

FROM ${PYTHON_IMAGE}
RUN useradd --system --uid 10001 --user-group --home-dir /data --create-home \
        --shell /usr/sbin/nologin breakpod
COPY --from=build /opt/breakpod /opt/breakpod
# 0.0.0.0: in a container the broker must listen on the container's address to
# be reachable at all (compose network, Kubernetes Service); that is safe here
# because every call but /healthz and /readyz needs a bearer token
# (BREAKPOD_BROKER_TOKENS). Publish the port on 127.0.0.1 only, as compose.yml does.
# Move the port with BREAKPOD_BROKER_PORT (not --port): the HEALTHCHECK reads it too.
ENV PATH=/opt/breakpod/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    BREAKPOD_BROKER_HOST=0.0.0.0 \
    BREAKPOD_BROKER_PORT=8765
WORKDIR /data
USER 10001:10001
EXPOSE 8765
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('BREAKPOD_BROKER_PORT', '8765'), timeout=2)"]
ENTRYPOINT ["breakpod-broker"]
CMD ["serve"]
