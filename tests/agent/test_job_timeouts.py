"""Debug mode owns the process group's timeout; debug mode off touches nothing
(a real one-rank gloo group in a child process, the installed autostart .pth)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

PROBE = """
import datetime, json, threading
import torch, torch.distributed as dist
import breakpod
wrapped = hasattr(dist.init_process_group, "__breakpod_original__")
dist.init_process_group("gloo", rank=0, world_size=1, timeout=datetime.timedelta(seconds=15))
breakpod.step()
gloo = dist.distributed_c10d._get_default_group()._get_backend(torch.device("cpu"))
print(json.dumps({
    "wrapped": wrapped,
    "timeout": gloo.options._timeout.total_seconds(),
    "threads": sorted(t.name for t in threading.enumerate() if t.name.startswith("breakpod")),
}))
dist.destroy_process_group()
"""


def probe(code: str = PROBE, **env: str) -> dict[str, object]:
    """The JSON that ``code`` prints last, and its ``stderr``, run with a free MASTER_PORT
    and no breakpod settings."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    clean = {k: v for k, v in os.environ.items() if not k.startswith("BREAKPOD_")}
    clean.pop("ENABLE_REMOTE_DEBUG", None)
    clean.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), **env)
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=clean,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "stderr": done.stderr}


def test_debug_mode_off_wraps_nothing_starts_no_thread_and_keeps_the_timeout():
    found = probe()
    assert found == {"wrapped": False, "timeout": 15.0, "threads": [], "stderr": ""}


def test_debug_mode_gives_the_group_room_for_a_park_and_watches_the_users_timeout():
    found = probe(ENABLE_REMOTE_DEBUG="1", BREAKPOD_HOLD_SECONDS="60")
    assert found["wrapped"] is True
    assert found["timeout"] == 60 + 1800  # the hold time + an attached session's margin
    assert found["threads"] == ["breakpod-watchdog"]


def test_a_hold_with_no_limit_gives_the_group_a_year():
    """``forever`` made init_process_group raise OverflowError (a negative hold is now
    refused: it fell back to the default)."""
    for hold in ("forever", "inf"):
        found = probe(ENABLE_REMOTE_DEBUG="1", BREAKPOD_HOLD_SECONDS=hold)
        assert found["wrapped"] is True and found["timeout"] == 365 * 24 * 3600, found


def test_a_debug_flag_that_is_no_yes_or_no_is_off_everywhere():
    """``ENABLE_REMOTE_DEBUG=2`` was on for the watchdog and off for the .pth: peers waited
    for a park while their process group kept the user's short timeout."""
    found = probe(ENABLE_REMOTE_DEBUG="2")
    assert (found["wrapped"], found["timeout"], found["threads"]) == (False, 15.0, [])
    assert "ENABLE_REMOTE_DEBUG='2' is not a boolean" in str(found["stderr"])


BAD_TIMEOUT = """
import json
import torch.distributed as dist
try:
    dist.init_process_group("gloo", rank=0, world_size=1, timeout=15)  # seconds, not a timedelta
except Exception as e:
    print(json.dumps({"error": type(e).__name__, "said": str(e)}))
"""


def test_a_timeout_torch_refuses_is_refused_in_torchs_words_not_breakpods():
    """The wrapper read ``timeout.total_seconds()`` first: an int gave the user an
    AttributeError from inside breakpod instead of torch's own message."""
    plain = probe(BAD_TIMEOUT)
    debug = probe(BAD_TIMEOUT, ENABLE_REMOTE_DEBUG="1")
    assert plain["error"] != "AttributeError", plain
    assert (debug["error"], debug["said"]) == (plain["error"], plain["said"]), (debug, plain)
