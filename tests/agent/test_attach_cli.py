"""`breakpod attach`: the engineer's client, run as a real subprocess."""

from __future__ import annotations

import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.agent.test_breakpoint import SCRIPT, TOKEN_ENV

BREAKPOD = shutil.which("breakpod", path=str(Path(sys.executable).parent)) or "breakpod"


def run_cli(*args: str, stdin: str = "", env: dict[str, str] | None = None, timeout: float = 30):
    return subprocess.run(
        [BREAKPOD, *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HOME": os.environ.get("TMPDIR", "/tmp"), **(env or {})},
    )


def test_attach_runs_commands_and_exits_when_the_session_ends(spawn):
    child = spawn(SCRIPT)
    result = run_cli("attach", f"127.0.0.1:{child.park_port()}", stdin="p x\nc\n")
    assert result.returncode == 0, result.stderr
    assert "41" in result.stdout
    assert "the remote side closed the session" in result.stdout
    assert child.wait() == 0


def test_eof_on_the_terminal_detaches_and_the_program_continues(spawn):
    child = spawn(SCRIPT)
    result = run_cli("attach", f"127.0.0.1:{child.park_port()}", stdin="p x\n")
    assert result.returncode == 0
    assert "detached; the program continues" in result.stdout
    assert child.wait() == 0
    assert "finished 42" in child.stdout()


def test_attach_sends_the_token_when_the_listener_asks(spawn):
    child = spawn(SCRIPT, env=TOKEN_ENV)
    result = run_cli(
        "attach",
        f"127.0.0.1:{child.park_port()}",
        stdin="p x\nc\n",
        env={"BREAKPOD_LISTENER_TOKEN": "s3cret-token"},
    )
    assert "41" in result.stdout and "token required" not in result.stdout
    assert child.wait() == 0


def test_nothing_listening_is_a_clear_error_not_a_traceback():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound but not listening: connection refused
        result = run_cli("attach", f"127.0.0.1:{port}")
    assert result.returncode == 2
    assert "nothing accepts connections on 127.0.0.1" in result.stderr
    assert "Traceback" not in result.stderr


def test_bad_address_is_a_clear_error():
    result = run_cli("attach", "localhost:notaport")
    assert result.returncode == 2 and "is not HOST:PORT" in result.stderr


def test_vscode_prints_a_launch_json_for_debugpy():
    result = run_cli("attach", "--vscode", "127.0.0.1:5678", "--remote-root", "/workspace")
    config = json.loads(result.stdout)["configurations"][0]
    assert config["type"] == "debugpy" and config["request"] == "attach"
    assert config["connect"] == {"host": "127.0.0.1", "port": 5678}
    assert config["pathMappings"][0]["remoteRoot"] == "/workspace"


def _serve_once(script) -> int:
    """A one-connection TCP server on 127.0.0.1 running ``script(conn)``; returns its port."""
    server = socket.create_server(("127.0.0.1", 0))

    def run() -> None:
        with server:
            conn, _ = server.accept()
            script(conn)

    threading.Thread(target=run, daemon=True).start()
    return server.getsockname()[1]


def test_a_character_split_across_reads_is_not_garbled():
    def script(conn: socket.socket) -> None:
        data = "x∈[-3.2, 4.1] μ=0.01\n(Pdb) ".encode()
        cut = data.index("∈".encode()) + 1  # in the middle of the UTF-8 sequence
        conn.sendall(data[:cut])
        time.sleep(0.2)
        conn.sendall(data[cut:])
        conn.recv(100)
        conn.close()

    result = run_cli("attach", f"127.0.0.1:{_serve_once(script)}", stdin="c\n")
    assert "x∈[-3.2, 4.1] μ=0.01" in result.stdout, result.stdout


def test_a_reset_connection_is_a_clear_error():
    def script(conn: socket.socket) -> None:
        conn.sendall(b"breakpod: attached\n")
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        time.sleep(0.2)
        conn.close()  # RST instead of FIN

    result = run_cli("attach", f"127.0.0.1:{_serve_once(script)}")
    assert result.returncode == 2
    assert "the connection to the debugger broke" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("greeting", "said"),
    [
        (b"", "closed the connection without a word"),  # was: exit 0, "session closed"
        (b"SSH-2.0-OpenSSH_9.6\r\n", "said b'SSH-2.0"),  # was: attached, waited for ever
        (b"\x00\x01\x02garbage\xff", "said b'\\x00"),  # was: raw bytes to the terminal
    ],
)
def test_a_peer_that_is_no_debugger_is_named_not_attached(greeting, said):
    def script(conn: socket.socket) -> None:
        conn.sendall(greeting)
        if greeting.startswith(b"SSH"):
            time.sleep(5)  # holds the connection open, as sshd does
        conn.close()

    result = run_cli("attach", f"127.0.0.1:{_serve_once(script)}", timeout=20)
    assert result.returncode == 2, result
    assert said in result.stderr and "not a debugger listener" in result.stderr, result.stderr


def test_a_host_name_with_an_empty_label_is_a_clear_error():
    result = run_cli("attach", "a..b:1")
    assert result.returncode == 2 and "'a..b' is not a host name" in result.stderr, result
    assert "Traceback" not in result.stderr
