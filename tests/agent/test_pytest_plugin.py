"""The pytest plugin, run by pytest's own ``pytester`` in a child pytest with stdin closed."""

from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from breakpod._core import hosting, notice
from tests.conftest import Child

pytest_plugins = ["pytester"]

TESTS = """
def test_passes():
    assert True

def test_loss():
    loss = 0.5
    threshold = 0.1
    assert loss < threshold
"""

TWO_FAILURES = """
import pytest

def test_first():
    step = 1
    assert step == 0

def test_second():
    step = 2
    pytest.fail("second failure")
"""

NOT_CI = {"CI": "", "GITHUB_ACTIONS": "", "GITLAB_CI": "", "BUILDKITE": "", "JENKINS_URL": ""}
TIMING = re.compile(r" in [\d.]+s")
# fd 0 closed before Python starts (sys.stdin is None): a CI runner's stdin at its barest
STDIN_CLOSED = ("/bin/sh", "-c", 'exec "$@" <&-', "sh")


@pytest.fixture
def job(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester's folder as a job's project: no breakpod setting and no CI inherited."""
    for name in [n for n in os.environ if n.startswith("BREAKPOD_")]:
        monkeypatch.delenv(name)
    for name, value in {**NOT_CI, "PYTHONUNBUFFERED": "1", "BREAKPOD_PORT": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("PYTHONBREAKPOINT", "breakpod.set_trace")
    pytester.makeini("[pytest]\n")
    return pytester


def _argv(pytester: pytest.Pytester, args: tuple[str, ...]) -> list[str]:
    basetemp = pytester.path / "basetemp"
    pytest_argv = [sys.executable, "-m", "pytest", f"--basetemp={basetemp}", "test_job.py"]
    return [*STDIN_CLOSED, *pytest_argv, *args]


@pytest.fixture
def run_pytest(job: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """run_pytest(source, *args, env=...) -> RunResult: a child pytest on test_job.py, ended."""

    def _run(source: str, *args: str, env: dict[str, str] | None = None) -> pytest.RunResult:
        (job.path / "test_job.py").write_text(source)  # as given: the tests name its lines
        with monkeypatch.context() as m:
            for name, value in (env or {}).items():
                m.setenv(name, value)
            return job.run(*_argv(job, args), timeout=50)

    return _run


@pytest.fixture
def start_pytest(job: pytest.Pytester) -> Iterator[object]:
    """start_pytest(source, *args) -> Child: a child pytest to attach to while it runs."""
    children: list[Child] = []

    def _start(source: str, *args: str) -> Child:
        (job.path / "test_job.py").write_text(source)  # as given: the tests name its lines
        stderr_path = job.path / f"pytest{len(children)}.err"
        with open(stderr_path, "wb") as err:
            proc = job.popen(_argv(job, args), stdout=subprocess.PIPE, stderr=err)
        children.append(Child(proc, stderr_path))
        return children[-1]

    yield _start
    for child in children:
        if child.proc.poll() is None:
            child.proc.kill()
            child.proc.wait(timeout=10)


def test_failing_test_is_attachable_then_reported_as_usual(start_pytest, pdb_client):
    child = start_pytest(TESTS, "--breakpod", "--breakpod-hold", "30")
    port = child.park_port()
    client = pdb_client(port)
    banner = client.read_until()
    assert "test_job.py::test_loss failed" in banner
    assert "-> assert loss < threshold" in banner  # the failing frame, not pytest's
    assert client.command("p loss, threshold").strip() == "(0.5, 0.1)"
    client.send("c")
    assert "continuing" in client.read_all()
    assert child.wait() == 1
    out = child.stdout()
    assert "1 failed, 1 passed" in out and "E       assert 0.5 < 0.1" in out
    assert f"breakpod attach 127.0.0.1:{port}" in child.stderr  # the standout block
    assert "test_job.py::test_loss failed; held for a debugger" in child.stderr


def test_nobody_attaching_finishes_after_the_hold_and_holds_once(run_pytest):
    started = time.monotonic()
    run = run_pytest(TWO_FAILURES, "--breakpod", "--breakpod-hold", "1")
    assert run.ret == 1
    assert time.monotonic() - started >= 1
    assert "2 failed" in run.stdout.str()
    assert run.stderr.str().count("waiting up to 1s") == 1  # nobody watches: no second hold
    assert "nobody attached within 1s" in run.stderr.str()


@pytest.mark.parametrize("first", [False, True])
def test_after_an_attach_later_failures_hold_unless_first(start_pytest, pdb_client, first):
    flags = ["--breakpod-first"] if first else []
    child = start_pytest(TWO_FAILURES, "--breakpod", "--breakpod-hold", "1.5", *flags)
    client = pdb_client(child.park_port())
    client.read_until()
    assert client.command("p step").strip() == "1"
    client.send("c")
    client.read_all()
    assert child.wait() == 1
    held = child.stderr.count("waiting up to 1.5s")
    assert held == (1 if first else 2)
    if not first:  # the second hold starts in the test, not in pytest.fail()
        assert re.search(r"where\s+\S*test_job\.py:10\n", child.stderr)


def test_without_breakpod_the_plugin_changes_nothing(run_pytest):
    def outcome(*args: str) -> tuple[int, str, str]:
        run = run_pytest(TESTS, *args)
        lines = [ln for ln in run.stdout.str().splitlines() if not ln.startswith("plugins:")]
        return run.ret, TIMING.sub("", "\n".join(lines)), run.stderr.str()

    installed = outcome()
    removed = outcome("-p", "no:breakpod")
    assert installed == removed
    assert installed[0] == 1 and installed[2] == ""


def test_inactive_plugin_loads_no_debugger_code(run_pytest):
    probe = TESTS + (
        "\ndef test_probe():\n"
        "    import sys\n"
        "    loaded = {\n"
        "        'breakpod._debug.breakpoints',\n"
        "        'breakpod._debug.debugger',\n"
        "        'breakpod._debug.listener',\n"
        "    }\n"
        "    assert not loaded & set(sys.modules)\n"
    )
    run = run_pytest(probe)
    assert run.ret == 1
    assert "1 failed, 2 passed" in run.stdout.str()


def test_breakpod_ci_env_enables_it_and_ci_holds_600s(run_pytest):
    ci = run_pytest(TESTS, "--co", env={"BREAKPOD_CI": "1", "GITHUB_ACTIONS": "true"})
    assert ci.ret == 0
    assert "breakpod: failures are held 600s" in ci.stdout.str()
    local = run_pytest(TESTS, "--co", "--breakpod")
    assert local.ret == 0
    assert "breakpod: failures are not held" in local.stdout.str()


def test_github_actions_gets_an_error_annotation(run_pytest, job):
    workspace = str(job.path.parent)  # the job's folder inside it, as a checkout's subfolder
    github = {"BREAKPOD_CI": "1", "GITHUB_ACTIONS": "1", "GITHUB_WORKSPACE": workspace}
    run = run_pytest(TESTS, "--breakpod-hold", "0.2", env=github)
    assert run.ret == 1
    line = next(ln for ln in run.stdout.str().splitlines() if ln.startswith("::error "))
    file = re.escape(f"{job.path.name}/test_job.py")
    assert re.match(rf"::error file={file},line=8,title=breakpod%3A test held::", line)
    assert "test_job.py::test_loss failed" in line and "breakpod attach 127.0.0.1:" in line


def test_gitlab_gets_a_collapsible_section(run_pytest):
    run = run_pytest(TESTS, "--breakpod", "--breakpod-hold", "0.2", env={"GITLAB_CI": "true"})
    assert run.ret == 1
    assert re.search(
        r"section_start:\d+:breakpod_held_failure\[collapsed=false\]", run.stderr.str()
    )
    assert "section_end:" in run.stderr.str()


def test_collection_error_is_held_at_the_failing_import(run_pytest):
    run = run_pytest("import no_such_module_xyz\n", "--breakpod", "--breakpod-hold", "0.2")
    assert run.ret == 2  # pytest's status for a collection error
    assert "error   ModuleNotFoundError: No module named 'no_such_module_xyz'" in run.stderr.str()
    assert re.search(r"where\s+\S*test_job\.py:1\n", run.stderr.str())


def test_bad_hold_value_is_a_usage_error(run_pytest):
    run = run_pytest(TESTS, "--breakpod", "--breakpod-hold", "soon")
    assert run.ret == 4
    assert "--breakpod-hold='soon' is not a number of seconds" in run.stderr.str()


def test_xdist_workers_get_distinct_ports(run_pytest):
    pytest.importorskip("xdist")
    base = _free_port_pair()
    two = TESTS.replace(
        "def test_passes():\n    assert True", "def test_other():\n    x = 1\n    assert x == 2"
    )
    run = run_pytest(
        two, "-n", "2", "--breakpod", "--breakpod-hold", "1", env={"BREAKPOD_PORT": str(base)}
    )
    assert run.ret == 1
    ports = {
        int(p)
        for p in re.findall(
            r"waiting up to 1s for a debugger on 127\.0\.0\.1:(\d+)", run.stderr.str()
        )
    }
    assert ports == {base, base + 1}


@pytest.mark.skipif(sys.platform != "linux", reason="DAP test runs on Linux")
def test_debugpy_backend_shows_the_failure_to_a_dap_client(start_pytest):
    pytest.importorskip("debugpy")
    from tests.dap import DapClient

    child = start_pytest(
        TESTS, "--breakpod", "--breakpod-backend", "debugpy", "--breakpod-hold", "30"
    )
    port = int(child.wait_for(r"waiting up to 30s for a DAP client on 127\.0\.0\.1:(\d+)").group(1))
    client = DapClient(port)
    try:
        client.handshake()
        stopped = client.wait_event("stopped")
        thread = stopped["body"]["threadId"]
        top = client.top_frame(thread)
        assert top["name"] == "test_loss"
        assert client.frame_locals(top["id"])["loss"] == "0.5"
        client.call("continue", threadId=thread)
    finally:
        client.close()
    assert child.wait(timeout=30) == 1
    assert "1 failed, 1 passed" in child.stdout()


# -- the pieces the block is made of -------------------------------------------------


def test_annotation_escapes_workflow_command_syntax():
    failure = notice.Failure(
        "t.py::test[a,b]", "ValueError: 100%\nbad", "/w/t.py", 3, "pdb", "127.0.0.1", 5678, 600
    )
    line = notice.github_annotation(failure)
    assert "\n" not in line and "100%25%0Abad" in line
    assert line.startswith("::error file=") and ",line=3," in line


def test_reach_hints_name_the_pod_for_kubernetes():
    where = hosting.detect(
        {
            "KUBERNETES_SERVICE_HOST": "10.0.0.1",
            "POD_NAME": "train-0",
            "POD_NAMESPACE": "ml",
            "HOSTNAME": "train-0",
        }
    )
    hints = hosting.reach_hints(where, "127.0.0.1", 5679)
    assert (
        hints[0]
        == "kubectl port-forward -n ml pod/train-0 5679:5679  then  breakpod attach 127.0.0.1:5679"
    )


def _free_port_pair() -> int:
    """A port P with P+1 free too (probed, then released), below the kernel's ephemeral
    range (32768 up): there no connection another test opens takes P+1 in between (one
    did in a clean-clone run, and the second worker listened elsewhere, as it should)."""
    start = random.randrange(20000, 31000, 2)
    for port in range(start, start + 1000, 2):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no two adjacent free ports")


BREAKPOINT_TEST = """
def test_stops_here():
    x = 41
    breakpoint()
    assert x + 1 == 42
"""


def test_a_breakpoint_in_a_test_parks_and_its_line_is_not_captured(run_pytest):
    """Without a terminal, pytest's pdb quit at breakpoint() (BdbQuit: the test failed in
    a blink, nothing parked), unless PYTHONBREAKPOINT was exported too."""
    run = run_pytest(
        BREAKPOINT_TEST, "--breakpod", env={"PYTHONBREAKPOINT": "", "BREAKPOD_HOLD_SECONDS": "1"}
    )
    assert run.ret == 0, run.stdout.str()
    assert "1 passed" in run.stdout.str()
    said = run.stderr.str()  # while it waited, not in the test's captured output
    assert "breakpoint() at" in said and "waiting up to 1s for a debugger" in said, said
    assert "nobody attached within 1s" in said
