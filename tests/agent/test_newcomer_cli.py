"""The CLI does what its flags say, on a real broker and real jobs:

* a loop with only the breakpoint hook and a broker (``PYTHONBREAKPOINT``,
  ``BREAKPOD_BROKER_URL`` and its token) registers at its first ``breakpod.step()``,
  so ``breakpod send JOB break`` reaches it;
* ``breakpod attach JOB`` on a job of one process attaches to its one session (it
  was a raw HTTP 404), and ``--rank 0`` on a job with no ranks says so;
* ``breakpod attach SESSION`` on a debugpy session exits 2, as by address, and the
  launch.json maps onto the job's working directory both ways;
* ``breakpod events --job JOB``: every rank's events, no other job's.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.agent.test_attach_cli import run_cli
from tests.agent.test_newcomer_attach import DEBUGPY_JOB, DEBUGPY_PORT, session_of
from tests.brokerkit import AGENT, VIEWER, post_events, register, wait_until
from tests.dap import continue_parked

LOOP = """
    import time
    import breakpod
    for i in range(1200):
        breakpod.step(i)
        time.sleep(0.05)
    print("loop done", flush=True)
"""


def cli_env(broker):
    return {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_BROKER_TOKEN": VIEWER}


def job_sessions(broker, job):
    with broker.client(VIEWER) as c:
        return [s for s in c.get("/v1/sessions").json()["sessions"] if s.get("job") == job]


@pytest.mark.timeout(120)
def test_a_loop_with_only_the_hook_and_a_broker_registers_and_attach_takes_its_job(broker, spawn):
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    child = spawn(LOOP, env={**env, "BREAKPOD_JOB": "loopjob", "BREAKPOD_HOLD_SECONDS": "60"})
    (session,) = wait_until(lambda: job_sessions(broker, "loopjob"), timeout=30)
    admin = {**cli_env(broker), "BREAKPOD_BROKER_TOKEN": "admin-token-0001"}
    sent = run_cli("send", "loopjob", "break", env=admin)
    assert sent.returncode == 0, sent.stderr
    child.wait_for(r"waiting .* for a debugger on", timeout=30)

    no_rank = run_cli("attach", "loopjob", "--rank", "0", env=cli_env(broker))
    assert no_rank.returncode == 2
    assert "job 'loopjob' has no ranks (its processes set no RANK)" in no_rank.stderr
    assert session["id"] in no_rank.stderr and "None" not in no_rank.stderr

    attached = run_cli("attach", "loopjob", stdin="p i\nc\n", env=cli_env(broker))
    assert attached.returncode == 0, attached.stderr
    assert "HTTP 404" not in attached.stderr and "(Pdb)" in attached.stdout
    child.proc.kill()


def test_attach_to_an_unknown_job_names_the_jobs_the_broker_knows(broker):
    register(broker, "s-known", job="knownjob")
    result = run_cli("attach", "nosuchjob", env=cli_env(broker))
    assert result.returncode == 2
    assert "no session or running job 'nosuchjob'" in result.stderr
    assert "knownjob" in result.stderr and "HTTP 404" not in result.stderr


@pytest.mark.timeout(90)
def test_attach_session_on_a_debugpy_session_exits_2_like_by_address(broker, spawn):
    env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    child = spawn(DEBUGPY_JOB, env=env, stdin="closed")
    port = int(child.wait_for(DEBUGPY_PORT).group(1))
    session = wait_until(lambda: session_of(broker, "parked"), timeout=30)
    by_session = run_cli("attach", session["id"], env=cli_env(broker))
    by_address = run_cli("attach", f"127.0.0.1:{port}")
    for result in (by_session, by_address):
        assert result.returncode == 2, result.stderr
        assert "is a debugpy (DAP) listener, not a remote pdb" in result.stderr
        mapping = json.loads(result.stdout)["configurations"][0]["pathMappings"][0]
        assert mapping["remoteRoot"] == session["cwd"] == os.getcwd()  # the job's own
    vscode = run_cli("attach", "--vscode", f"127.0.0.1:{port}")
    assert vscode.returncode == 0, vscode.stderr
    mapping = json.loads(vscode.stdout)["configurations"][0]["pathMappings"][0]
    assert mapping["remoteRoot"] == os.getcwd()
    continue_parked(port)
    assert child.wait(timeout=30) == 0


def test_events_of_a_job_are_every_rank_s_and_no_other_job_s(broker):
    for n, (session, job) in enumerate([("ev-r0", "evjob"), ("ev-r1", "evjob"), ("ev-x", "other")]):
        register(broker, session, job=job, rank=n)
        event = {"id": f"{session}.1", "session": session, "kind": "log"}
        assert post_events(broker, {**event, "fields": {"message": f"from {session}"}})
    shown = run_cli("events", "--job", "evjob", env=cli_env(broker))
    assert shown.returncode == 0, shown.stderr
    assert "from ev-r0" in shown.stdout and "from ev-r1" in shown.stdout
    assert "from ev-x" not in shown.stdout
    missing = run_cli("events", "--job", "nojob", env=cli_env(broker))
    assert missing.returncode == 2 and "no session of job 'nojob'" in missing.stderr
