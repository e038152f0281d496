"""The mutating admission webhook: AdmissionReview v1 in, JSONPatch out.

It applies the chart-rendered debug overlay (:mod:`breakpod_broker.overlay`)
to pods labelled ``breakpod.dev/inject: "true"``; the namespace opt-in is the
MutatingWebhookConfiguration's namespaceSelector. It never denies a pod: any
problem gives ``allowed: true``, no patch and a warning, since a debugging
aid must not stop a training job from starting.

The endpoint carries no bearer token: the API server calls it, and it returns
only a patch that references the token Secret by name. It is therefore not
part of the broker's plain-HTTP app: serve it alone, over TLS (the chart runs
this next to the broker)::

    python -m breakpod_broker.admission --port 8443 --certfile tls.crt --keyfile tls.key

The certificate is re-read when its file changes (a cert-manager renewal, a
rotated Secret), so injection goes on without a restart.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import ssl
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import APIRouter, FastAPI, HTTPException, Request

from breakpod_broker import overlay
from breakpod_broker.context import healthz
from breakpod_broker.overlay import Json

log = logging.getLogger(__name__)

OVERLAY_ENV = "BREAKPOD_OVERLAY_FILE"
DEFAULT_OVERLAY_FILE = "/etc/breakpod/overlay/overlay.json"
API_VERSION = "admission.k8s.io/v1"

router = APIRouter(tags=["admission"])


class ReviewError(ValueError):
    """The request is not an AdmissionReview v1; the message says what is wrong."""


def review(body: Mapping[str, Any], rendered: Mapping[str, Any] | None) -> Json:
    """The AdmissionReview response for ``body`` (``rendered`` None: no overlay)."""
    request = _request(body)
    response: Json = {"uid": request["uid"], "allowed": True}
    warnings: list[str] = []
    try:
        patch = _patch(request, rendered, warnings)
    except overlay.OverlayError as e:
        response["warnings"] = [f"breakpod: {e}; the pod is left unchanged"]
        patch = []
    except Exception as e:  # a pod no rule foresaw: never an error that blocks its creation
        log.warning("pod %s left unchanged: %s: %s", request["uid"], type(e).__name__, e)
        response["warnings"] = [
            f"breakpod: could not inject into this pod ({type(e).__name__}: {e}); "
            "the pod is left unchanged"
        ]
        patch = []
    if warnings:
        response["warnings"] = warnings
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch).encode()).decode()
    return {"apiVersion": API_VERSION, "kind": "AdmissionReview", "response": response}


def _request(body: Mapping[str, Any]) -> Json:
    if body.get("apiVersion") != API_VERSION or body.get("kind") != "AdmissionReview":
        raise ReviewError(f"expected an AdmissionReview with apiVersion {API_VERSION}")
    request = body.get("request")
    if not isinstance(request, dict) or not isinstance(request.get("uid"), str):
        raise ReviewError("the AdmissionReview has no request.uid (a string)")
    if not request["uid"]:
        raise ReviewError("the AdmissionReview has an empty request.uid")
    return request


def _patch(request: Json, rendered: Mapping[str, Any] | None, warnings: list[str]) -> list[Json]:
    pod = request.get("object")
    if _object(request, "kind").get("kind") != "Pod" or not isinstance(pod, dict):
        return []
    meta = _object(pod, "metadata")
    if _object(meta, "labels").get(overlay.INJECT_LABEL) != "true":
        return []
    if rendered is None:
        raise overlay.OverlayError(f"no overlay file (set {OVERLAY_ENV})")
    target = _object(meta, "annotations").get(overlay.CONTAINER_ANNOTATION)
    spec = _object(pod, "spec")
    containers = spec.get("containers") or []
    if not isinstance(containers, list) or not all(isinstance(c, dict) for c in containers):
        raise overlay.OverlayError("spec.containers is not a list of objects")
    if target is not None and not isinstance(target, str):
        raise overlay.OverlayError(f"annotation {overlay.CONTAINER_ANNOTATION} is not a string")
    debugged, notes = overlay.apply_reporting(spec, rendered, target)
    warnings.extend(f"breakpod: {note}" for note in notes)
    return overlay.json_patch({"spec": spec}, {"spec": debugged})  # paths under /spec


def _object(parent: Mapping[str, Any], key: str) -> Json:
    """``parent[key]`` when it is an object ({} when absent); a malformed pod gets
    a warning and no patch (OverlayError), not an error that could block it."""
    value = parent.get(key) or {}
    if not isinstance(value, dict):
        raise overlay.OverlayError(f"{key} is a {type(value).__name__}, not an object")
    return value


def current_overlay() -> Json | None:
    """The overlay at $BREAKPOD_OVERLAY_FILE, re-read when the ConfigMap changes."""
    path = Path(os.environ.get(OVERLAY_ENV) or DEFAULT_OVERLAY_FILE)
    try:
        stamp = path.stat().st_mtime_ns
    except OSError:
        return None
    return _load(path, stamp)


@lru_cache(maxsize=4)
def _load(path: Path, stamp: int) -> Json | None:
    try:
        return overlay.load(path)
    except overlay.OverlayError as e:
        log.error("%s", e)
        return None


# The API server sends objects of at most ~3 MiB, twice for an update (object and
# oldObject): a larger body is nobody's AdmissionReview, and read whole it could take the
# webhook (and the broker pod it runs in) past its memory limit.
MAX_REVIEW_BYTES = 8 << 20
_TOO_LARGE = f"an AdmissionReview is at most {MAX_REVIEW_BYTES >> 20} MiB"


@router.post("/admission/mutate")
async def mutate(request: Request) -> Json:
    """Mutate a pod: AdmissionReview v1 in, AdmissionReview with a JSONPatch out."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_REVIEW_BYTES:
        raise HTTPException(413, _TOO_LARGE)
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_REVIEW_BYTES:
            raise HTTPException(413, _TOO_LARGE)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise HTTPException(400, "the body is not JSON: send an AdmissionReview v1") from None
    if not isinstance(body, dict):
        raise HTTPException(400, "the body is not a JSON object: send an AdmissionReview v1")
    try:
        return review(body, current_overlay())
    except ReviewError as e:
        raise HTTPException(400, str(e)) from None


def create_app() -> FastAPI:
    """The webhook alone, for a TLS-serving container next to the broker."""
    app = FastAPI(title="breakpod admission webhook", docs_url=None, redoc_url=None)
    app.include_router(router)
    app.add_api_route("/healthz", healthz, methods=["GET"])
    return app


# -- serving over TLS, with certificate reload ---------------------------------

RELOAD_SECONDS = 10.0


class CertificateReloader:
    """Loads the certificate into the server's SSL context again whenever the
    files change; new connections get the new one, open ones keep theirs."""

    def __init__(self, context: ssl.SSLContext, certfile: str, keyfile: str) -> None:
        self.context, self.certfile, self.keyfile = context, certfile, keyfile
        self.stamp = self._stamp()

    def _stamp(self) -> tuple[int, int]:
        return os.stat(self.certfile).st_mtime_ns, os.stat(self.keyfile).st_mtime_ns

    def check(self) -> bool:
        """True when a changed certificate was loaded; a half-written pair is
        retried on the next check, the old certificate serving meanwhile."""
        try:
            stamp = self._stamp()
            if stamp == self.stamp:
                return False
            # a trial context first: a failed load leaves a context half-changed (the new
            # certificate without its key), and the live one must keep serving the old pair
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(self.certfile, self.keyfile)
            self.context.load_cert_chain(self.certfile, self.keyfile)
        except (OSError, ssl.SSLError) as e:
            log.warning("webhook certificate not reloaded (yet): %s", e)
            return False
        self.stamp = stamp
        log.info("webhook certificate reloaded from %s", self.certfile)
        return True

    async def watch(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            self.check()


def serve(host: str, port: int, certfile: str, keyfile: str, every: float) -> None:
    config = uvicorn.Config(
        create_app(), host=host, port=port, ssl_certfile=certfile, ssl_keyfile=keyfile
    )
    config.load()  # builds the SSL context the reloader keeps current
    assert config.ssl is not None
    reloader = CertificateReloader(config.ssl, certfile, keyfile)

    async def run() -> None:
        watcher = asyncio.create_task(reloader.watch(every))
        try:
            await uvicorn.Server(config).serve()
        finally:
            watcher.cancel()

    asyncio.run(run())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="the breakpod admission webhook, over TLS")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8443)
    parser.add_argument("--certfile", required=True)
    parser.add_argument("--keyfile", required=True)
    parser.add_argument("--reload-seconds", type=float, default=RELOAD_SECONDS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    serve(args.host, args.port, args.certfile, args.keyfile, args.reload_seconds)


if __name__ == "__main__":
    main()
