"""A minimal Debug Adapter Protocol client over a real socket (what VS Code speaks)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any


class DapClient:
    def __init__(self, port: int, host: str = "127.0.0.1", timeout: float = 15.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout)
        self.buffer = b""
        self.seq = 0
        self.messages: list[dict[str, Any]] = []

    def request(self, command: str, **arguments: Any) -> int:
        self.seq += 1
        body = json.dumps(
            {"seq": self.seq, "type": "request", "command": command, "arguments": arguments}
        ).encode()
        self.sock.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        return self.seq

    def call(self, command: str, **arguments: Any) -> dict[str, Any]:
        seq = self.request(command, **arguments)
        return self.wait(lambda m: m.get("type") == "response" and m.get("request_seq") == seq)

    def handshake(self) -> None:
        """What an IDE does to attach: initialize, attach, configurationDone."""
        assert self.call("initialize", adapterID="debugpy", clientID="breakpod-test")["success"]
        self.request("attach", justMyCode=False)
        self.wait_event("initialized")
        assert self.call("configurationDone")["success"]

    def top_frame(self, thread: int) -> dict[str, Any]:
        return dict(self.call("stackTrace", threadId=thread)["body"]["stackFrames"][0])

    def frame_locals(self, frame_id: int) -> dict[str, str]:
        """Name -> value of the innermost scope of a frame."""
        scopes = self.call("scopes", frameId=frame_id)["body"]["scopes"]
        ref = scopes[0]["variablesReference"]
        found = self.call("variables", variablesReference=ref)["body"]["variables"]
        return {v["name"]: v["value"] for v in found}

    def wait_event(self, name: str) -> dict[str, Any]:
        return self.wait(lambda m: m.get("type") == "event" and m.get("event") == name)

    def wait(self, predicate: Any, timeout: float = 15.0) -> dict[str, Any]:
        """The first message (seen before or arriving now) matching ``predicate``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while time.monotonic() < deadline:
            for message in self.messages[seen:]:
                if predicate(message):
                    self.messages.remove(message)
                    return message
            seen = len(self.messages)
            self.messages.append(self._read())
        raise TimeoutError("no matching DAP message")

    def _read(self) -> dict[str, Any]:
        while b"\r\n\r\n" not in self.buffer:
            self._fill()
        header, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        length = int(header.split(b"Content-Length:")[1].split(b"\r\n")[0])
        while len(self.buffer) < length:
            self._fill()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return dict(json.loads(body))

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise EOFError("the debug adapter closed the connection")
        self.buffer += data

    def close(self) -> None:
        self.sock.close()


def continue_parked(port: int) -> None:
    """What an IDE does with a parked job: attach, see it stopped, continue it."""
    client = DapClient(port)
    try:
        client.handshake()
        stopped = client.wait_event("stopped")
        client.call("continue", threadId=stopped["body"]["threadId"])
    finally:
        client.close()
