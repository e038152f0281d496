"""The debug overlay for training pods, applied the way the Helm chart applies it.

The overlay itself is data, rendered once by the chart's ``breakpod.overlay``
template (helm/breakpod/templates/_overlay.tpl) into a ConfigMap that the
webhook mounts; this module only applies it. The merge rules are the chart's
``breakpod.merge`` rules, so the named template and the webhook give the
same pod spec (tests/deploy proves it)::

    {"pod": {...}, "container": {...}}   merged into the pod spec / the target container:
      key: null          -> the key is removed        (e.g. livenessProbe under policy remove)
      key: [{name: ..}]  -> merged by item name: same name replaced in place, new ones appended
      key: anything else -> set
    except: a pod's own runtimeClassName is never replaced (KEEP_EXISTING)

The webhook also moves the debug port when another port of the pod already
uses it (and says so in the admission warnings). The target container is the
one named by the pod annotation ``breakpod.dev/container``, else the first one.
Applying twice changes nothing.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonpatch

CONTAINER_ANNOTATION = "breakpod.dev/container"
INJECT_LABEL = "breakpod.dev/inject"
# Pod fields the overlay sets only where the pod has none (never replaced).
KEEP_EXISTING = frozenset({"runtimeClassName"})
PORT_ENV = "BREAKPOD_PORT"
TOKEN_ENV = "BREAKPOD_LISTENER_TOKEN"

Json = dict[str, Any]


class OverlayError(ValueError):
    """The overlay file or the pod cannot be used; the message says why."""


def load(path: str | Path) -> Json:
    """Read a rendered overlay (JSON) and check its shape."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise OverlayError(f"cannot read the overlay {path}: {e}") from e
    if not isinstance(data, dict) or not all(
        isinstance(data.get(k, {}), dict) for k in ("pod", "container")
    ):
        raise OverlayError(f"{path}: an overlay is an object with 'pod' and 'container' objects")
    return data


def merge(target: Mapping[str, Any], patch: Mapping[str, Any]) -> Json:
    """``target`` with ``patch`` merged in by the three rules above (a new dict)."""
    out = copy.deepcopy(dict(target))
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and _named(value):
            out[key] = _merge_named(out.get(key) or [], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _named(items: list[Any]) -> bool:
    return all(isinstance(i, dict) and "name" in i for i in items)


def _merge_named(current: list[Any], items: list[Json]) -> list[Any]:
    new = {i["name"]: i for i in items}
    merged = [copy.deepcopy(new.get(c.get("name"), c)) for c in current]
    seen = {c.get("name") for c in current}
    return merged + [copy.deepcopy(i) for i in items if i["name"] not in seen]


def target_index(spec: Mapping[str, Any], container: str | None) -> int:
    """Index of the container to debug: the named one, else the first."""
    containers = spec.get("containers") or []
    if not containers:
        raise OverlayError("the pod has no containers")
    if not container:
        return 0
    for i, c in enumerate(containers):
        if c.get("name") == container:
            return i
    names = ", ".join(str(c.get("name")) for c in containers)
    raise OverlayError(
        f"{CONTAINER_ANNOTATION}={container!r} names no container of this pod (it has: {names})"
    )


def apply(
    spec: Mapping[str, Any], overlay: Mapping[str, Any], container: str | None = None
) -> Json:
    """The pod spec with the overlay applied to the pod and its target container."""
    return apply_reporting(spec, overlay, container)[0]


def apply_reporting(
    spec: Mapping[str, Any], overlay: Mapping[str, Any], container: str | None = None
) -> tuple[Json, list[str]]:
    """``apply``, and notes on what it changed from the overlay to fit the pod: a
    pod's own runtimeClassName is kept; a debug port another container of the
    pod already uses moves to the next free one; a hostNetwork pod without a
    listener token is warned of."""
    index = target_index(spec, container)
    pod = {k: v for k, v in (overlay.get("pod") or {}).items() if not _kept(spec, k)}
    notes = [f"the pod's runtimeClassName {spec[k]!r} is kept" for k in KEEP_EXISTING & set(spec)]
    patch, moved = _free_port(spec, overlay.get("container") or {})
    if spec.get("hostNetwork") is True and not _sets(patch, TOKEN_ENV):
        notes.append(
            "a hostNetwork pod's 127.0.0.1 is the node's loopback: every process on the "
            f"node can reach its debugger; give the overlay a token ({TOKEN_ENV})"
        )
    out = merge(spec, pod)
    containers = list(out["containers"])
    containers[index] = merge(containers[index], patch)
    out["containers"] = containers
    return out, notes + moved


def _sets(container: Mapping[str, Any], name: str) -> bool:
    return any(isinstance(e, dict) and e.get("name") == name for e in container.get("env") or [])


def _kept(spec: Mapping[str, Any], key: str) -> bool:
    return key in KEEP_EXISTING and bool(spec.get(key))


def _free_port(spec: Mapping[str, Any], patch: Json) -> tuple[Json, list[str]]:
    """``patch`` with its debug port (and BREAKPOD_PORT) moved off ports in use."""
    ours = {p.get("name") for p in patch.get("ports") or [] if isinstance(p, dict)}
    containers = [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]
    used = {  # init containers' too: a native sidecar (restartPolicy Always) runs beside
        p.get("containerPort")
        for c in containers
        if isinstance(c, dict)
        for p in (c.get("ports") or [])
        if isinstance(p, dict) and p.get("name") not in ours
    }
    ports = [dict(p) for p in patch.get("ports") or []]
    notes, env = [], [dict(e) for e in patch.get("env") or []]
    for port in ports:
        wanted = port.get("containerPort")
        if isinstance(wanted, int) and wanted in used:
            above = range(int(wanted) + 1, 65536)
            free = next((n for n in [*above, *range(1024, int(wanted))] if n not in used), None)
            if free is None:
                raise OverlayError(f"port {wanted} is in use and no other port is free")
            port["containerPort"] = free
            for e in env:
                if e.get("name") == PORT_ENV and e.get("value") == str(wanted):
                    e["value"] = str(free)
            notes.append(f"port {wanted} is in use in this pod: the debug listener uses {free}")
    if not notes:
        return patch, []
    return {**patch, "ports": ports, **({"env": env} if env else {})}, notes


def json_patch(before: Any, after: Any) -> list[Json]:
    """RFC 6902 operations that turn ``before`` into ``after`` (``jsonpatch``'s diff)."""
    ops: list[Json] = jsonpatch.make_patch(before, after).patch
    return ops
