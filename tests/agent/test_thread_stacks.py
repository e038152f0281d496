"""One stack format for the agent's own dump and for py-spy's: the user's threads
first, breakpod's folded last, and a reader that gets the threads back."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from breakpod._job import thread_stacks, watchdog

SPY = Path(sys.executable).with_name("py-spy")


def parked_thread(name: str) -> tuple[threading.Thread, threading.Event]:
    done = threading.Event()
    thread = threading.Thread(target=done.wait, name=name, daemon=True)
    thread.start()
    return thread, done


def test_the_agents_dump_shows_the_users_threads_first_and_folds_its_own() -> None:
    _, stop_own = parked_thread("breakpod-emitter")
    _, stop_user = parked_thread("loader")
    try:
        text = watchdog.format_stacks()
    finally:
        stop_own.set()
        stop_user.set()
    blocks = text.split("\n\n")
    assert blocks[0].startswith('Thread "MainThread" (tid ')
    assert any(b.startswith('Thread "loader"') for b in blocks)
    assert 'Thread "breakpod-emitter"' not in text
    assert text.rstrip("\n").splitlines()[-1].startswith("(breakpod's own threads, folded: ")
    assert "breakpod-emitter" in text.rstrip("\n").splitlines()[-1]


def test_the_text_reads_back_as_the_same_threads() -> None:
    threads = thread_stacks.current()
    back = thread_stacks.parse(thread_stacks.format_threads(threads))
    # names repeat (two threads of a pytest-xdist worker share one), and breakpod's own
    # threads are folded into one line of names
    assert len(back) == len(threads)
    for thread in threads:
        if thread.own:
            assert any(b.name == thread.name and b.frames == () for b in back)
        else:
            assert thread in back


def test_native_frames_read_back() -> None:
    frame = thread_stacks.Frame("c10d::Reducer::finalize_backward", "/x/libtorch_cpu.so", 0, True)
    text = thread_stacks.format_threads([thread_stacks.Thread("MainThread", (frame,), 7)])
    assert "  native c10d::Reducer::finalize_backward (libtorch_cpu.so)" in text
    (back,) = thread_stacks.parse(text)
    assert back.frames == (thread_stacks.Frame(frame.function, "libtorch_cpu.so", 0, True),)


@pytest.mark.timeout(60)
@pytest.mark.skipif(not SPY.exists(), reason="py-spy is not installed (requirements-dev.txt)")
def test_py_spys_dump_prints_in_the_same_format(tmp_path: Path) -> None:
    """The program never imports threading: py-spy has no thread name, the main thread
    is told by its id."""
    script = tmp_path / "job.py"
    script.write_text(
        "import time\ndef wait():\n    time.sleep(60)\nprint(1, flush=True)\nwait()\n"
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == b"1\n"
        dump = subprocess.run(
            [str(SPY), "dump", "--json", "--pid", str(proc.pid)],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
    finally:
        proc.kill()
        proc.wait(timeout=10)
    (main,) = thread_stacks.from_pyspy(json.loads(dump.stdout))
    text = thread_stacks.format_threads([main])
    assert text.startswith('Thread "MainThread"')
    assert f'  File "{script}", line 3, in wait\n    time.sleep(60)\n' in text
    assert main.user_frame() == thread_stacks.Frame("wait", str(script), 3)
