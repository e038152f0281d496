"""How an engineer reaches a session's listener, per runtime.

Kubernetes: ``kubectl port-forward`` to the pod (the listener binds the pod's
127.0.0.1); compose/docker: the port published on the host's 127.0.0.1;
local: the address itself. Plus the ``breakpod attach`` command and, for
debugpy, a VS Code ``launch.json``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, HTTPException, Query
from pydantic import BaseModel

from breakpod_broker.auth import Viewer
from breakpod_broker.context import Broker, get_broker
from breakpod_broker.sessions import SessionId, SessionOut, get_session

router = APIRouter(prefix="/v1/sessions", tags=["attach"])


class AttachInfo(BaseModel):
    session: str
    runtime: Literal["kubernetes", "compose", "docker", "local"]
    listener: Literal["pdb", "debugpy"]
    state: str
    connect: str  # HOST:PORT to connect to, after port_forward when there is one
    port_forward: str | None = None
    attach_command: str
    direct_command: str
    vscode_launch: dict[str, Any] | None = None


@router.get("/{session_id}/attach", response_model=AttachInfo)
async def attach_info(
    session_id: SessionId,
    who: Viewer,
    broker: Annotated[Broker, Depends(get_broker)],
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
    port_forward = None
    if session.runtime == "kubernetes" and session.pod and session.namespace:
        local = local_port or remote_port
        port_forward = (
            f"kubectl port-forward -n {session.namespace} pod/{session.pod} {local}:{remote_port}"
        )
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
        port_forward=port_forward,
        attach_command=f"breakpod attach {session.id}"
        + (" --vscode" if listener == "debugpy" else ""),
        direct_command=f"breakpod attach {'--vscode ' if listener == 'debugpy' else ''}{connect}",
        vscode_launch=vscode_launch(session.id, host, int(port)) if listener == "debugpy" else None,
    )


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
