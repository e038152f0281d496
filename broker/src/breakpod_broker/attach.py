"""How an engineer reaches a session's listener, per runtime.

Kubernetes: ``kubectl port-forward`` to the pod (the listener binds the pod's
127.0.0.1); compose/docker: the port published on the host's 127.0.0.1;
local: the address itself. Plus the ``breakpod attach`` command and, for
debugpy, a VS Code ``launch.json``.
"""

from __future__ import annotations

import shlex
from typing import Annotated, Any

from fastapi import APIRouter, HTTPException, Query

from breakpod import protocol
from breakpod_broker.auth import Viewer
from breakpod_broker.context import BrokerDep
from breakpod_broker.models import AttachInfo, SessionId, SessionOut
from breakpod_broker.sessions import get_session

router = APIRouter(tags=["attach"])


@router.get(protocol.attach_path("{session_id}"), response_model=AttachInfo)
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
    if session.runtime == protocol.KUBERNETES and session.pod and session.namespace:
        local = local_port or remote_port
        argv = port_forward_argv(session.namespace, session.pod, local, remote_port)
        connect = f"127.0.0.1:{local}"
    else:
        connect = session.attach_address or protocol.reachable(session.address)
    listener = session.listener or protocol.DEFAULT_LISTENER
    editor = listener == protocol.DAP_LISTENER
    host, _, port = connect.rpartition(":")
    return AttachInfo(
        session=session.id,
        runtime=session.runtime,
        listener=listener,
        state=session.state,
        connect=connect,
        port_forward=shlex.join(argv) if argv else None,
        port_forward_argv=argv,
        attach_command=f"breakpod attach {session.id}" + (" --vscode" if editor else ""),
        direct_command=f"breakpod attach {'--vscode ' if editor else ''}{connect}",
        vscode_launch=_launch(session, host, int(port)) if editor else None,
        cwd=session.cwd,
    )


def _launch(session: SessionOut, host: str, port: int) -> dict[str, Any]:
    return protocol.vscode_launch(session.id, host, port, remote_root=session.cwd or ".")


def port_forward_argv(namespace: str, pod: str, local: int, remote: int) -> list[str]:
    """kubectl's argv; the names are checked again here, since a session stored by an
    older broker may hold anything, and they end up on an engineer's machine."""
    if not (protocol.is_dns_label(namespace) and protocol.is_dns_subdomain(pod)):
        raise HTTPException(
            409, f"namespace {namespace!r} / pod {pod!r} are not Kubernetes names: not forwarding"
        )
    return ["kubectl", "port-forward", "-n", namespace, f"pod/{pod}", f"{local}:{remote}"]
