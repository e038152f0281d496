"""The pytest plugin, run as a real pytest in a child process with stdin closed."""

from __future__ import annotations

import re
import socket
import sys
import time
from pathlib import Path

import pytest

from breakpod._core import hosting, notice

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

PYTEST = "import sys, pytest\nraise SystemExit(pytest.main(sys.argv[1:]))\n"
NOT_CI = {"CI": "", "GITHUB_ACTIONS": "", "GITLAB_CI": "", "BUILDKITE": "", "JENKINS_URL": ""}
TIMING = re.compile(r" in [\d.]+s")


@pytest.fixture
def run_pytest(spawn, tmp_path: Path):
    """run_pytest(source, *args, env=...) -> Child running pytest on a test file."""

    def _run(source: str, *args: str, env: dict[str, str] | None = None):
        project = tmp_path / "project"
        project.mkdir(exist_ok=True)
        (project / "pytest.ini").write_text("[pytest]\n")
        (project / "test_job.py").write_text(source)
        argv = ["-p", "no:cacheprovider", "--rootdir", str(project), str(project), *args]
        return spawn(PYTEST, args=argv, env={**NOT_CI, **(env or {})}, stdin="closed")

    return _run


def test_failing_test_is_attachable_then_reported_as_usual(run_pytest, pdb_client):
    child = run_pytest(TESTS, "--breakpod", "--breakpod-hold", "30")
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
    child = run_pytest(TWO_FAILURES, "--breakpod", "--breakpod-hold", "1")
    assert child.wait() == 1
    assert time.monotonic() - started >= 1
    assert "2 failed" in child.stdout()
    assert child.stderr.count("waiting up to 1s") == 1  # nobody watches: no second hold
    assert "nobody attached within 1s" in child.stderr


@pytest.mark.parametrize("first", [False, True])
def test_after_an_attach_later_failures_hold_unless_first(run_pytest, pdb_client, first):
    flags = ["--breakpod-first"] if first else []
    child = run_pytest(TWO_FAILURES, "--breakpod", "--breakpod-hold", "1.5", *flags)
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
        child = run_pytest(TESTS, *args)
        status = child.wait()
        lines = [ln for ln in child.stdout().splitlines() if not ln.startswith("plugins:")]
        return status, TIMING.sub("", "\n".join(lines)), child.stderr

    installed = outcome()
    removed = outcome("-p", "no:breakpod")
    assert installed == removed
    assert installed[0] == 1 and installed[2] == ""


def test_inactive_plugin_loads_no_debugger_code(run_pytest):
    probe = TESTS + (
        "\ndef test_probe():\n"
        "    import sys\n"
        "    loaded = {\n"
        "        'breakpod._debug.shim',\n"
        "        'breakpod._debug.debugger',\n"
        "        'breakpod._debug.listener',\n"
        "    }\n"
        "    assert not loaded & set(sys.modules)\n"
    )
    child = run_pytest(probe)
    assert child.wait() == 1
    assert "1 failed, 2 passed" in child.stdout()


def test_breakpod_ci_env_enables_it_and_ci_holds_600s(run_pytest):
    child = run_pytest(TESTS, "--co", env={"BREAKPOD_CI": "1", "GITHUB_ACTIONS": "true"})
    assert child.wait() == 0
    assert "breakpod: failures are held 600s" in child.stdout()
    local = run_pytest(TESTS, "--co", "--breakpod")
    assert local.wait() == 0
    assert "breakpod: failures are not held" in local.stdout()


def test_github_actions_gets_an_error_annotation(run_pytest, tmp_path):
    github = {"BREAKPOD_CI": "1", "GITHUB_ACTIONS": "1", "GITHUB_WORKSPACE": str(tmp_path)}
    child = run_pytest(TESTS, "--breakpod-hold", "0.2", env=github)
    assert child.wait() == 1
    line = next(ln for ln in child.stdout().splitlines() if ln.startswith("::error "))
    assert re.match(r"::error file=project/test_job\.py,line=8,title=breakpod%3A test held::", line)
    assert "test_job.py::test_loss failed" in line and "breakpod attach 127.0.0.1:" in line


def test_gitlab_gets_a_collapsible_section(run_pytest):
    child = run_pytest(TESTS, "--breakpod", "--breakpod-hold", "0.2", env={"GITLAB_CI": "true"})
    assert child.wait() == 1
    assert re.search(r"section_start:\d+:breakpod_held_failure\[collapsed=false\]", child.stderr)
    assert "section_end:" in child.stderr


def test_collection_error_is_held_at_the_failing_import(run_pytest):
    child = run_pytest("import no_such_module_xyz\n", "--breakpod", "--breakpod-hold", "0.2")
    assert child.wait() == 2  # pytest's status for a collection error
    assert "error   ModuleNotFoundError: No module named 'no_such_module_xyz'" in child.stderr
    assert re.search(r"where\s+\S*test_job\.py:1\n", child.stderr)


def test_bad_hold_value_is_a_usage_error(run_pytest):
    child = run_pytest(TESTS, "--breakpod", "--breakpod-hold", "soon")
    assert child.wait() == 4
    assert "--breakpod-hold='soon' is not a number of seconds" in child.stderr


def test_xdist_workers_get_distinct_ports(run_pytest):
    pytest.importorskip("xdist")
    base = _free_port_pair()
    two = TESTS.replace(
        "def test_passes():\n    assert True", "def test_other():\n    x = 1\n    assert x == 2"
    )
    child = run_pytest(
        two, "-n", "2", "--breakpod", "--breakpod-hold", "1", env={"BREAKPOD_PORT": str(base)}
    )
    assert child.wait(timeout=45) == 1
    ports = {
        int(p)
        for p in re.findall(r"waiting up to 1s for a debugger on 127\.0\.0\.1:(\d+)", child.stderr)
    }
    assert ports == {base, base + 1}


@pytest.mark.skipif(sys.platform != "linux", reason="DAP test runs on Linux")
def test_debugpy_backend_shows_the_failure_to_a_dap_client(run_pytest):
    pytest.importorskip("debugpy")
    from tests.dap import DapClient

    child = run_pytest(
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
    """A port P with P+1 free too (probed, then released)."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            with socket.socket() as b:
                try:
                    b.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
        return port
    raise RuntimeError("no two adjacent free ports")
