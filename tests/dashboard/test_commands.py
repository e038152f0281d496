"""The command buttons in real chromium: drawn for admin tokens only, the ones that
fit the rank's state, each one confirmed before it is sent, its acknowledgement
shown as it arrives; the break button parks a real agent and the resume button
lets it go."""

from __future__ import annotations

import pytest

from tests.brokerkit import VIEWER, register, wait_until
from tests.dashboard.pagekit import LOOP, agent_env, login, sessions, until


def command_events(broker, session_id):
    with broker.client(VIEWER) as c:
        found = c.get("/v1/events", params={"session": session_id, "kind": "command"})
    return found.json()["events"]


def test_a_viewer_sees_no_command_buttons_and_the_api_refuses_it(broker, page):
    register(broker, "s-view", job="train-view", rank=0, world_size=1)
    login(page, broker, VIEWER)
    page.click(".rank[data-session='s-view']")
    page.wait_for_selector("#detail:not([hidden]) .facts")
    page.wait_for_selector("#detail .plots")  # the whole view is drawn
    assert page.locator("#detail .actions, #detail button.action, #detail .confirm").count() == 0
    with broker.client(VIEWER) as c:
        refused = c.post("/v1/sessions/s-view/commands", json={"command": "break"})
    assert refused.status_code == 403
    assert command_events(broker, "s-view") == []


@pytest.mark.timeout(120)
def test_the_admin_buttons_dump_stacks_park_and_resume_a_real_agent(broker, spawn, page):
    child = spawn(LOOP, env=agent_env(broker, 0, world_size=1, job="train-admin"))
    found = wait_until(lambda: [s for s in sessions(broker) if s["job"] == "train-admin"], 30)
    sid = found[0]["id"]
    cell = f".rank[data-session='{sid}']"
    login(page, broker, "admin-token-0001")
    page.wait_for_selector(f"{cell}[data-state=running]")
    page.click(cell)
    page.wait_for_selector("#detail .actions button.action[data-command=break]")
    # the buttons that fit a running rank (nothing to resume)
    assert page.locator("#detail button.action").all_text_contents() == [
        "break",
        "dump-stacks",
        "dump-flight",
    ]

    # nothing is sent before the confirmation, and cancel sends nothing
    page.click("#detail button.action[data-command=break]")
    page.wait_for_selector("#detail .confirm[data-command=break]")
    assert command_events(broker, sid) == []
    page.click("#detail .confirm .no")
    page.wait_for_selector("#detail .confirm", state="detached")
    assert command_events(broker, sid) == []

    ack = confirm(page, "dump-stacks")
    ack.locator("summary").click()
    assert "time.sleep(0.01)" in ack.locator("pre").inner_text()  # the child's own main loop

    ack = confirm(page, "break")
    child.wait_for("break requested through the broker", timeout=30)
    page.wait_for_selector(f"{cell}[data-state=parked]")
    assert "park" in ack.locator(".ack-detail").text_content()
    page.wait_for_selector("#detail button.action[data-command=resume]")
    # a parked rank is not broken again
    assert page.locator("#detail button.action").all_text_contents() == [
        "resume",
        "dump-stacks",
        "dump-flight",
    ]

    confirm(page, "resume")
    until(page, f"['running', 'finished'].includes(document.querySelector(`{cell}`).dataset.state)")
    assert child.proc.wait(30) == 0
    page.wait_for_selector(f"{cell}[data-state=finished]")
    assert page.locator("#detail button.action").count() == 0  # it takes no more commands
    assert page.locator("#detail .ack[data-command=resume][data-state=done]").count() == 1


def confirm(page, name):
    """Click a command's button, confirm, and wait for the agent's acknowledgement."""
    before = page.locator(f"#detail .ack[data-command='{name}']").count()
    page.click(f"#detail button.action[data-command='{name}']")
    page.click(f"#detail .confirm[data-command='{name}'] .yes")
    ack = page.locator(f"#detail .ack[data-command='{name}']").first
    until(
        page, f"document.querySelectorAll(`#detail .ack[data-command='{name}']`).length > {before}"
    )
    page.wait_for_selector(f"#detail .ack[data-command='{name}'][data-state=done]", timeout=30_000)
    assert ack.locator(".states").text_content().startswith("queued → delivered → done")
    return ack
