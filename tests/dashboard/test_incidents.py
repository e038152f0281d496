"""The incident view in real chromium: a process killed with SIGKILL while parked turns
lost on an open page; a stall's culprit, a failure's reason and a park's countdown
on the job card, ticking; 500 sessions with events flowing within a redraw budget;
focus and a selection kept; links that survive a reload; keyboard-only use; a
390 px screen; stale data dimmed while the broker is away; AA contrast."""

from __future__ import annotations

import math
import re
import signal
import time
from pathlib import Path

import pytest

import breakpod_broker
from tests.broker.test_incidents import REPORT
from tests.brokerkit import ADMIN, AGENT, post_events, register, wait_until
from tests.dashboard.pagekit import LOOP, agent_env, login, send, sessions, until, watch_state


def card(page, job):
    return page.locator(f"article.job[data-job='{job}']")


@pytest.mark.timeout(150)
def test_a_sigkilled_parked_job_turns_lost_on_an_open_page(start_broker, spawn, page):
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="20")  # a real agent beats every 12-15 s
    child = spawn(LOOP, env=agent_env(broker, 0, world_size=1, job="train-oom"))
    sid = wait_until(lambda: [s["id"] for s in sessions(broker) if s["job"] == "train-oom"], 30)[0]
    login(page, broker)
    send(broker, sid, "break")
    page.wait_for_selector(f".rank[data-session='{sid}'][data-state=parked]", timeout=30_000)
    page.click(f".rank[data-session='{sid}']")
    page.wait_for_selector("#detail .attach pre")
    page.evaluate("window.__sameDocument = true")
    watch_state(page, sid, "lost", flag="__lostAt")
    child.proc.send_signal(signal.SIGKILL)  # as the OOM killer does: no word from the process
    killed = time.time()
    child.wait()
    lost_at = until(page, "window.__lostAt", timeout=30) / 1000
    print(f"\nSIGKILL -> lost on the open page: {lost_at - killed:.1f} s (TTL 20 s)")
    assert lost_at - killed < 20 + 3
    assert page.evaluate("window.__sameDocument") is True  # no reload
    headline = card(page, "train-oom").locator(".incident").text_content()
    assert headline.startswith("rank 0 lost: no heartbeat") and "(was parked)" in headline
    assert "silent for" in headline
    page.wait_for_selector("#detail .attach", state="detached")  # nothing listens any more
    assert page.locator("#detail .actions button.action").count() == 0


TICK = "article.job[data-job='train-stall'] .incident .tick"


def test_a_stall_names_its_culprit_where_and_for_how_long_on_the_card(broker, page):
    for rank in (0, 1):
        register(broker, f"r{rank}", job="train-stall", rank=rank, world_size=2)
    register(broker, "ok", job="train-fine", rank=0)
    own = {"seconds": 11.0, "step": 7, "rank": 1, "state": "user", "frame": "data.py:12 in fetch"}
    post_events(
        broker,
        {"id": "s1", "session": "r1", "kind": "stall", "fields": own},
        {"id": "s0", "session": "r0", "kind": "stall", "fields": {"seconds": 11.5, "rank": 0}},
        {"id": "j", "session": "r0", "kind": "stall", "time": time.time(), "fields": REPORT},
    )
    login(page, broker)
    job = card(page, "train-stall")
    job.locator(".incident").wait_for()
    assert page.get_attribute("article.job >> nth=0", "data-job") == "train-stall"
    text = job.locator(".incident").text_content()
    assert text.startswith("2 ranks stalled: culprit rank 1 at data.py:12 in fetch (step 7")
    assert "stalled for" in text
    for rank in ("r0", "r1"):  # every rank's row names the culprit, not only rank 0's
        row = job.locator(f"tr[data-session='{rank}'] td.reason").text_content()
        assert row.startswith("culprit rank 1 at data.py:12 in fetch")
    tick = job.locator(".incident .tick").first
    before = tick.text_content()
    until(
        page,
        f"document.querySelector({TICK!r}).textContent !== {before!r}",
        5,
    )
    assert page.is_hidden("#detail")  # all of it without opening anything


def test_a_failed_job_and_a_killed_one_are_urgent_with_their_reason(broker, page):
    register(broker, "good", job="train-good", rank=0)
    for rank in (0, 1):
        register(broker, f"f{rank}", job="train-failed", rank=rank, world_size=2)
    register(broker, "oom", job="train-oom", rank=0)
    post_events(
        broker,
        {"id": "a", "session": "f1", "kind": "finished", "fields": {"exit": 1}},
        {"id": "b", "session": "f1", "kind": "finished", "fields": {"signal": 15}},  # the echo
        {"id": "c", "session": "f0", "kind": "finished", "fields": {"signal": 15}},
        {"id": "d", "session": "good", "kind": "finished", "fields": {"exit": 0}},
        {
            "id": "e",
            "session": "oom",
            "kind": "killed",
            "fields": {"reason": "OOMKilled", "exit": 137},
        },
    )
    login(page, broker)
    page.wait_for_selector("article.job[data-job='train-failed'] .incident")
    order = page.eval_on_selector_all("article.job", "cards => cards.map(c => c.dataset.job)")
    assert order.index("train-oom") < order.index("train-good")
    assert order.index("train-failed") < order.index("train-good")
    failed = card(page, "train-failed")
    assert failed.get_attribute("data-state") == "killed"  # rank 0's SIGTERM is the worst state
    headline = failed.locator(".incident").text_content()  # but rank 1 ended first: the cause
    assert headline == "rank 1 failed: exit 1 (the first of 2 ranks to end)"
    assert failed.locator("tr[data-session='f1'] td.reason").text_content() == "exit 1"
    assert failed.locator("tr[data-session='f1'] .chip").text_content() == "failed"
    oom = card(page, "train-oom").locator(".incident").text_content()
    assert oom == "rank 0 killed: OOMKilled (exit 137)"
    assert card(page, "train-good").locator(".incident").count() == 0  # nothing to say


def test_a_park_counts_down_its_hold_and_the_attach_block_fits_the_runtime(broker, page):
    kube = {"runtime": "kubernetes", "pod": "train-0", "namespace": "ml", "job": "kube", "rank": 0}
    register(broker, "k0", address="127.0.0.1:5678", listener="pdb", **kube)
    register(
        broker,
        "c0",
        job="comp",
        runtime="compose",
        address="0.0.0.0:5678",
        attach_address="127.0.0.1:15678",
        listener="pdb",
    )
    parked = {"reason": "NaN in loss", "address": "127.0.0.1:5678", "hold_until": time.time() + 600}
    post_events(
        broker,
        {"id": "p", "session": "k0", "kind": "parked", "fields": parked},
        {
            "id": "q",
            "session": "c0",
            "kind": "parked",
            "fields": {**parked, "address": "0.0.0.0:5678"},
        },
    )
    login(page, broker)
    headline = card(page, "kube").locator(".incident")
    headline.wait_for()
    assert "rank 0 parked: NaN in loss · holds 9m5" in headline.text_content()
    page.click(".rank[data-session='k0']")
    block = page.locator("#detail section.attach[data-runtime=kubernetes]")
    block.wait_for()
    commands = block.locator("pre").all_text_contents()
    assert "export BREAKPOD_BROKER_URL=" + broker.url in commands[0]
    assert "BREAKPOD_BROKER_TOKEN=<your viewer or admin token>" in commands[0]
    assert commands[1] == "breakpod attach k0"  # it runs the port-forward itself
    assert commands[2].startswith("kubectl port-forward -n ml pod/train-0 5678:5678\n")
    page.keyboard.press("Escape")
    page.wait_for_selector("#detail", state="hidden")
    page.click(".rank[data-session='c0']")
    block = page.locator("#detail section.attach[data-runtime=compose]")
    block.wait_for()
    commands = block.locator("pre").all_text_contents()
    assert commands[1:] == ["breakpod attach c0", "breakpod attach 127.0.0.1:15678"]
    assert "kubectl" not in block.text_content()


# how often the page re-reads the listing, as app.js says
APP_JS = Path(breakpod_broker.__file__).with_name("static") / "app.js"
REFRESH_SECONDS = int(re.search(r"const REFRESH_MS = (\d+);", APP_JS.read_text())[1]) / 1000


@pytest.mark.timeout(240)
def test_500_sessions_with_events_flowing_redraw_only_what_changed(start_broker, page):
    broker = start_broker(BREAKPOD_HEARTBEAT_TTL_SECONDS="3600")  # registering takes a while
    ids = [f"big-{j:03d}-{r}" for j in range(125) for r in range(4)]
    for sid in ids:
        job, rank = sid.rsplit("-", 1)
        register(broker, sid, job=job, rank=int(rank), world_size=4, pod=f"{job}-{rank}")
    target = ids[7]
    post_events(
        broker,
        {
            "id": "p",
            "session": target,
            "kind": "parked",
            "fields": {"reason": "x", "address": "127.0.0.1:5678"},
        },
    )
    login(page, broker)
    until(page, f"document.querySelectorAll('.rank').length === {len(ids)}", timeout=60)
    page.click(f".rank[data-session='{target}']")
    page.wait_for_selector("#detail section.attach pre")
    # a selection in the attach command, and the focus on another rank
    page.evaluate("""() => { const pre = document.querySelector('#detail section.attach pre');
        const range = document.createRange(); range.selectNodeContents(pre);
        getSelection().removeAllRanges(); getSelection().addRange(range);
        window.__longTasks = 0; new PerformanceObserver((l) => { for (const e of l.getEntries())
        window.__longTasks += e.duration; }).observe({type: 'longtask', buffered: false}); }""")
    page.focus(f".rank[data-session='{ids[100]}']")
    before = page.evaluate("({...app.stats})")
    started = time.monotonic()
    for burst in range(8):  # 400 log events in ~4 s, one of them for the open session
        batch = [
            {
                "id": f"l{burst}-{i}",
                "session": ids[(burst * 50 + i) % len(ids)],
                "kind": "log",
                "fields": {"step": burst, "loss": 1.0},
            }
            for i in range(50)
        ]
        assert post_events(broker, *batch).status_code == 200
        time.sleep(0.5)
    post_events(broker, {"id": "s", "session": ids[101], "kind": "stall", "fields": {"seconds": 9}})
    page.wait_for_selector(f".rank[data-session='{ids[101]}'][data-state=stalled]")
    time.sleep(1)
    after = page.evaluate("({...app.stats})")
    window = time.monotonic() - started
    panel = after["panel"] - before["panel"]
    cards = after["cards"] - before["cards"]
    long_ms = page.evaluate("window.__longTasks")
    print(
        f"\n500 sessions, 400 log events + a stall in {time.monotonic() - started:.1f} s: "
        f"{after['renders'] - before['renders']} render passes, {cards} cards redrawn, "
        f"{panel} panel redraws, {long_ms:.0f} ms of long tasks"
    )
    # the stalled rank's card, and at most one more per re-read of the listing in the window
    # (each may bring what only the listing has: 5.6 s on a loaded machine held two)
    rereads = math.ceil(window / REFRESH_SECONDS)
    assert cards <= 1 + rereads, (cards, rereads)
    assert panel <= 2, panel  # the open session's one log event (plots, timeline)
    assert long_ms < 2000, long_ms
    assert page.evaluate("getSelection().toString()").startswith("export BREAKPOD_BROKER_URL")
    assert page.evaluate("document.activeElement.dataset.session") == ids[100]


def test_a_link_names_what_is_open_and_survives_a_reload(broker, page):
    for rank in (0, 1):
        register(broker, f"l{rank}", job="train-link", rank=rank, world_size=2)
    register(broker, "solo")
    login(page, broker)
    page.click(".rank[data-session='l1']")
    page.wait_for_selector("#detail:not([hidden]) .facts")
    assert page.url.endswith("#/job/train-link/rank/1")
    page.reload()
    page.wait_for_selector("#detail:not([hidden]) dd[data-fact=session]:has-text('l1')")
    page.goto(broker.url + "/#/session/solo")
    page.wait_for_selector("#detail:not([hidden]) dd[data-fact=session]:has-text('solo')")
    page.keyboard.press("Escape")
    page.wait_for_selector("#detail", state="hidden")
    assert "#/" not in page.url


def test_keyboard_only(broker, page):
    register(broker, "kb0", job="train-kb", rank=0, world_size=1)
    page.goto(broker.url + "/")
    page.wait_for_selector("#login:not([hidden]) #token")  # shown once a request got its 401
    page.focus("#token")
    page.keyboard.type(ADMIN)
    page.keyboard.press("Enter")
    page.wait_for_selector(".rank[data-session='kb0']")
    for _ in range(30):  # Tab until the rank's button has the focus
        page.keyboard.press("Tab")
        if page.evaluate("document.activeElement.dataset.session") == "kb0":
            break
    assert page.evaluate("document.activeElement.dataset.session") == "kb0"
    page.keyboard.press("Enter")
    page.wait_for_selector("#detail:not([hidden]) .actions button.action")
    assert page.evaluate("document.activeElement.closest('#detail') !== null")  # focus moved in
    page.focus("#detail button.action[data-command=break]")
    page.keyboard.press("Enter")
    page.wait_for_selector("#detail .confirm .yes")
    assert page.evaluate("document.activeElement.classList.contains('yes')")
    page.keyboard.press("Escape")  # cancels the confirmation, nothing sent
    page.wait_for_selector("#detail .confirm", state="detached")
    page.keyboard.press("Escape")  # closes the panel, focus back on the rank
    page.wait_for_selector("#detail", state="hidden")
    until(page, "document.activeElement.dataset.session === 'kb0'", 5)


def test_a_390_px_screen_has_one_column_and_nothing_wider_than_it(broker, page):
    page.set_viewport_size({"width": 390, "height": 844})
    for rank in range(8):
        register(
            broker,
            f"n{rank}",
            job="a-rather-long-training-job-name-for-a-phone",
            rank=rank,
            world_size=8,
            pod=f"a-rather-long-pod-name-{rank}",
        )
    post_events(
        broker,
        {
            "id": "p",
            "session": "n3",
            "kind": "parked",
            "fields": {
                "reason": "NaN in loss at model.layers.11.mlp.down_proj",
                "address": "127.0.0.1:5678",
            },
        },
    )
    login(page, broker)
    page.wait_for_selector(".rank[data-session='n3'][data-state=parked]")
    assert page.evaluate("document.documentElement.scrollWidth") <= 390
    page.click(".rank[data-session='n3']")
    page.wait_for_selector("#detail:not([hidden]) .facts")
    box = page.locator("#detail").bounding_box()
    assert box["x"] == 0 and box["width"] == 390  # the session over the jobs, full width
    assert page.evaluate("document.documentElement.scrollWidth") <= 390


@pytest.mark.timeout(120)
def test_stale_data_is_dimmed_while_the_broker_is_away(start_broker, page):
    broker = start_broker()
    register(broker, "st0", job="train-stale", rank=0)
    login(page, broker)
    page.wait_for_selector(".rank[data-session='st0']")
    assert page.is_hidden("#stale")
    broker.stop()
    page.wait_for_selector("#stale:not([hidden])", timeout=20_000)
    assert page.evaluate("document.getElementById('main').classList.contains('stale')")
    assert "does not answer" in page.text_content("#stale")
    broker.start()
    page.wait_for_selector("#stale", state="hidden", timeout=30_000)


def _luminance(rgb: str) -> float:
    values = [int(v) / 255 for v in rgb[rgb.index("(") + 1 : rgb.index(")")].split(",")[:3]]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in values]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def test_every_state_chip_meets_wcag_aa_contrast(broker, page):
    register(broker, "c", job="train-c", token=AGENT)
    login(page, broker)
    page.wait_for_selector("#legend .chip")
    colours = page.eval_on_selector_all(
        "#legend .chip",
        "chips => chips.map(c => [c.dataset.state, getComputedStyle(c).color,"
        " getComputedStyle(c).backgroundColor])",
    )
    assert {"failed", "killed", "lost", "stalled", "parked"} <= {s for s, _, _ in colours}
    for state, fg, bg in colours:
        light, dark = sorted((_luminance(fg), _luminance(bg)), reverse=True)
        ratio = (light + 0.05) / (dark + 0.05)
        assert ratio >= 4.5, (state, fg, bg, ratio)


def test_a_new_session_and_a_state_only_a_heartbeat_carried_appear_without_an_event(broker, page):
    register(broker, "h0", job="train-hb", rank=0)
    login(page, broker)
    page.wait_for_selector(".rank[data-session='h0']")
    register(broker, "h1", job="train-hb", rank=1)  # no event: only the listing knows
    with broker.client(AGENT) as c:
        beat = c.post("/v1/sessions/h0/heartbeat", json={"state": "stalled", "reason": "slow"})
        assert beat.status_code == 200, beat.text
    page.wait_for_selector(".rank[data-session='h1']", timeout=10_000)
    page.wait_for_selector(".rank[data-session='h0'][data-state=stalled]", timeout=10_000)
    # a beat redraws nothing, but the heartbeat age starts again from it
    cell = "article.job[data-job='train-hb'] tr[data-session='h0'] td.age .tick"
    before = page.evaluate(f"document.querySelector({cell!r}).dataset.since")
    cards = page.evaluate("app.stats.cards")
    with broker.client(AGENT) as c:
        beat = c.post("/v1/sessions/h0/heartbeat", json={}).json()["last_seen"]
    until(page, f"Number(document.querySelector({cell!r}).dataset.since) === {beat!r}", 10)
    assert float(before) < beat
    assert page.evaluate("app.stats.cards") == cards


def test_a_straggler_shows_its_step_lag_on_the_card_before_it_stalls(broker, page):
    """Each rank's heartbeat carries its last step; the card names the ranks behind the
    job's furthest and by how much, moved in place as beats arrive (no card redraw)."""
    for rank in (0, 1, 2):
        register(broker, f"lag{rank}", job="train-lag", rank=rank, world_size=3)

    def beat(session_id, step):
        with broker.client(AGENT) as c:
            reply = c.post(f"/v1/sessions/{session_id}/heartbeat", json={"step": step})
            assert reply.status_code == 200, reply.text

    for session_id, step in (("lag0", 1200), ("lag1", 950), ("lag2", 1200)):
        beat(session_id, step)
    login(page, broker)
    steps = card(page, "train-lag").locator("p.steps")
    until(
        page,
        "document.querySelector(\"article.job[data-job='train-lag'] p.steps[data-lagging=true]\")",
    )
    assert steps.text_content() == "furthest step 1200 · rank 1 at 950, 250 behind"
    assert steps.is_visible()
    cards = page.evaluate("app.stats.cards")
    beat("lag1", 1200)  # caught up: a beat changes the line, not the card
    until(
        page,
        "document.querySelector(\"article.job[data-job='train-lag'] p.steps[data-lagging=false]\")",
        10,
    )
    assert steps.text_content() == "step 1200: all 3 ranks"
    assert page.evaluate("app.stats.cards") == cards


def flight_dump(*first_bad):
    rows = [
        {"module": m, "phase": "forward", "step": s, "why": "nan", "rms": [1.1, "nan"]}
        for m, s in first_bad
    ]
    return {"steps": [0, 60], "kept": 61, "watched": 4, "first_bad": rows}


def test_the_flight_tables_of_every_rank_side_by_side_then_stacked_on_a_phone(broker, page):
    """A viewer's control reads each rank's newest dump (as ``breakpod flight`` does for
    a process that is gone); each rank's first bad row is marked, the job's earliest named."""
    for rank in (0, 1):
        register(broker, f"fl{rank}", job="train-flights", rank=rank, world_size=2)
    register(broker, "solo", job="train-solo", rank=0, world_size=1)
    r0 = flight_dump(("fc2", 57), ("<loss>", 57))
    r1 = flight_dump(("fc1", 55))
    post_events(
        broker,
        {"id": "a", "session": "fl0", "kind": "anomaly", "fields": {"rule": "nan", "flight": r0}},
        {"id": "d", "session": "fl1", "kind": "log", "fields": {"flight": r1}},
    )
    page.set_viewport_size({"width": 1400, "height": 900})
    login(page, broker)
    job = card(page, "train-flights")
    job.locator("button.load-flights").click()
    tables = job.locator("section.flights .flight-rank")
    page.wait_for_selector("article.job[data-job='train-flights'] .flight-rank >> nth=1")
    assert card(page, "train-solo").locator("button.load-flights").count() == 0  # one rank
    assert tables.count() == 2
    first, second = tables.nth(0), tables.nth(1)
    assert first.locator("h3").text_content() == "rank 0 · running"
    assert "from its anomaly event" in first.locator(".summary").text_content()
    assert "from its log event" in second.locator(".summary").text_content()
    a, b = first.bounding_box(), second.bounding_box()
    assert a["y"] == b["y"] and b["x"] >= a["x"] + a["width"]  # side by side
    for table, module, earliest in ((first, "fc2", "false"), (second, "fc1", "true")):
        marked = table.locator("tr.first-bad")
        assert marked.count() == 1 and marked.locator("td").first.text_content() == module
        assert marked.get_attribute("data-earliest") == earliest  # rank 1 went bad first
    page.set_viewport_size({"width": 390, "height": 844})
    until(page, "document.documentElement.scrollWidth <= 390")
    a, b = first.bounding_box(), second.bounding_box()
    assert b["y"] >= a["y"] + a["height"] and a["x"] == b["x"]  # stacked
