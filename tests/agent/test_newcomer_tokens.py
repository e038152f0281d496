"""Three secrets, three names: the listener's token, the job's broker token and the
CLI's broker token; the old BREAKPOD_TOKEN still works this release, with one line."""

from __future__ import annotations

from tests.agent.test_attach_cli import run_cli
from tests.agent.test_breakpoint import SCRIPT
from tests.brokerkit import AGENT, VIEWER, wait_until

LISTENER = "listener-secret-1"
DEPRECATED = "BREAKPOD_TOKEN is deprecated"


def sessions_seen(broker, **env):
    result = run_cli("sessions", "--json", env={"BREAKPOD_BROKER_URL": broker.url, **env})
    return result


def test_job_and_cli_each_use_their_own_broker_token(broker, spawn):
    job_env = {"BREAKPOD_BROKER_URL": broker.url, "BREAKPOD_AGENT_TOKEN": AGENT}
    child = spawn(SCRIPT, env=job_env, stdin="closed")
    child.park_port()
    # the CLI holds a viewer token; the agent token beside it in the environment is not used
    cli_env = {"BREAKPOD_BROKER_TOKEN": VIEWER, "BREAKPOD_AGENT_TOKEN": AGENT}
    listed = wait_until(lambda: '"parked"' in sessions_seen(broker, **cli_env).stdout, timeout=30)
    assert listed
    assert DEPRECATED not in child.stderr
    refused = sessions_seen(broker, BREAKPOD_AGENT_TOKEN=AGENT)  # no CLI token set
    assert refused.returncode != 0
    wrong_role = sessions_seen(broker, BREAKPOD_BROKER_TOKEN=AGENT)
    assert wrong_role.returncode != 0 and "an agent token may not do this" in wrong_role.stderr
    child.proc.kill()


def test_the_listener_token_has_its_own_name_and_flag(spawn):
    env = {"BREAKPOD_LISTENER_TOKEN": LISTENER, "BREAKPOD_REQUIRE_TOKEN": "1"}
    child = spawn(SCRIPT, env=env, stdin="closed")
    port = child.park_port()
    assert "a token is required: set BREAKPOD_LISTENER_TOKEN" in child.stderr
    wrong = run_cli("attach", f"127.0.0.1:{port}", env={"BREAKPOD_LISTENER_TOKEN": "not-it-at-all"})
    assert wrong.returncode != 0
    right = run_cli("attach", f"127.0.0.1:{port}", "--listener-token", LISTENER, stdin="c\n")
    assert right.returncode == 0, right.stderr
    assert DEPRECATED not in right.stderr
    assert child.wait(timeout=30) == 0


def test_the_old_name_still_works_with_one_deprecation_line(broker, spawn):
    env = {
        "BREAKPOD_TOKEN": AGENT,
        "BREAKPOD_REQUIRE_TOKEN": "1",
        "BREAKPOD_BROKER_URL": broker.url,
    }
    child = spawn(SCRIPT, env=env, stdin="closed")  # listener and broker link both read it
    port = child.park_port()
    wait_until(lambda: '"parked"' in sessions_seen(broker, BREAKPOD_BROKER_TOKEN=VIEWER).stdout, 30)
    result = run_cli("attach", f"127.0.0.1:{port}", stdin="c\n", env={"BREAKPOD_TOKEN": AGENT})
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(DEPRECATED) == 1
    assert child.wait(timeout=30) == 0
    assert child.stderr.count(DEPRECATED) == 1, child.stderr


def test_the_old_token_flag_keeps_its_meaning_per_command_with_a_line(broker):
    result = run_cli("sessions", "--broker", broker.url, "--token", VIEWER)
    assert result.returncode == 0, result.stderr
    assert "--token is deprecated here: use --broker-token" in result.stderr
    new = run_cli("sessions", "--broker", broker.url, "--broker-token", VIEWER)
    assert new.returncode == 0 and "deprecated" not in new.stderr


def test_a_bad_listener_token_still_refuses_to_listen(spawn):
    child = spawn(SCRIPT, env={"BREAKPOD_LISTENER_TOKEN": "short"}, stdin="closed")
    assert child.wait(timeout=30) == 0  # the job runs on, without a listener
    assert "BREAKPOD_LISTENER_TOKEN must be at least 8" in child.stderr
    assert "waiting up to" not in child.stderr
