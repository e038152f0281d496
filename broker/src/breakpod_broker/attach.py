"""How an engineer reaches a session's listener, per runtime.

Kubernetes: ``kubectl port-forward`` to the pod (the listener binds the pod's
127.0.0.1); compose/docker: the port published on the host's 127.0.0.1;
local: the address itself. Plus the ``breakpod attach`` command and, for
debugpy, a VS Code ``launch.json``.
"""

from __future__ import annotations

import re
import shlex
from typing import Annotated, Any, Literal

from fastapi import APIRouter, HTTPException, Query
from pydantic import BaseModel, Field

from breakpod_broker.auth import Viewer
from breakpod_broker.context import BrokerDep
from breakpod_broker.sessions import (
    DNS_LABEL,
    DNS_SUBDOMAIN,
    SessionId,
    SessionOut,
    get_session,
)

router = APIRouter(prefix="/v1/sessions", tags=["attach"])


class AttachInfo(BaseModel):
    session: str
    runtime: Literal["kubernetes", "compose", "docker", "local"]
    listener: Literal["pdb", "debugpy"]
    state: str
    connect: str  # HOST:PORT to connect to, after port_forward when there is one
    port_forward: str | None = Field(None, description="for display: port_forward_argv, quoted")
    port_forward_argv: list[str] | None = Field(
        None, description="kubectl port-forward as an argv list: run it without a shell"
    )
    attach_command: str
    direct_command: str
    vscode_launch: dict[str, Any] | None = None


@router.get("/{session_id}/attach", response_model=AttachInfo)
async def attach_info(
    session_id: SessionId,
    who: Viewer,
    broker: BrokerDep,
    local_port: Annotated[
        int | None, Query(ge=1, le=65535, description="local port for port-forward")
    ] = None,
) -> AttachInfo:
    """The commands that reach this session's debugger."""
    return instructions(await get_session(session_id, who, broker), local_port)


def instructions(session: SessionOut, local_port: int | None = None) -> AttachInfo:
    if not session.address:
        raise HTTPException(
            409, f"session {session.id!r} has no listener yet (state {session.state})"
        )
    remote_port = int(session.address.rpartition(":")[2] or 0)
    argv = None
    if session.runtime == "kubernetes" and session.pod and session.namespace:
        local = local_port or remote_port
        argv = port_forward_argv(session.namespace, session.pod, local, remote_port)
        connect = f"127.0.0.1:{local}"
    else:
        connect = session.attach_address or _reachable(session.address)
    listener = session.listener or "pdb"
    host, _, port = connect.rpartition(":")
    return AttachInfo(
        session=session.id,
        runtime=session.runtime,
        listener=listener,
        state=session.state,
        connect=connect,
        port_forward=shlex.join(argv) if argv else None,
        port_forward_argv=argv,
        attach_command=f"breakpod attach {session.id}"
        + (" --vscode" if listener == "debugpy" else ""),
        direct_command=f"breakpod attach {'--vscode ' if listener == 'debugpy' else ''}{connect}",
        vscode_launch=vscode_launch(session.id, host, int(port)) if listener == "debugpy" else None,
    )


def port_forward_argv(namespace: str, pod: str, local: int, remote: int) -> list[str]:
    """kubectl's argv; the names are checked again here, since a session stored by an
    older broker may hold anything, and they end up on an engineer's machine."""
    names_ok = re.match(DNS_LABEL, namespace) and re.match(DNS_SUBDOMAIN, pod) and len(pod) < 254
    if not names_ok:
        raise HTTPException(
            409, f"namespace {namespace!r} / pod {pod!r} are not Kubernetes names: not forwarding"
        )
    return ["kubectl", "port-forward", "-n", namespace, f"pod/{pod}", f"{local}:{remote}"]


def _reachable(address: str) -> str:
    """A wildcard bind (a container publishing its port) is reached on the host's 127.0.0.1."""
    host, _, port = address.rpartition(":")
    return f"127.0.0.1:{port}" if host.strip("[]") in ("0.0.0.0", "::", "") else address


def vscode_launch(session_id: str, host: str, port: int) -> dict[str, Any]:
    return {
        "version": "0.2.0",
        "configurations": [
            {
                "name": f"breakpod: {session_id}",
                "type": "debugpy",
                "request": "attach",
                "connect": {"host": host, "port": port},
                "pathMappings": [{"localRoot": "${workspaceFolder}", "remoteRoot": "."}],
                "justMyCode": False,
            }
        ],
    }
