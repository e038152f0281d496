"""The dashboard in real headless chromium, against a real broker, Redis and agents.

Measured and printed (run with -s): page load to first data, and the time
from the broker receiving an agent's event to the page showing it.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx

from breakpod_broker import dashboard
from tests.brokerkit import ADMIN, AGENT, AGENT2, VIEWER, register, wait_until
from tests.dashboard.pagekit import (
    LOOP,
    agent_env,
    jobs_shown,
    login,
    received,
    send,
    sessions,
    until,
    watch_state,
)

STATIC = Path(dashboard.__file__).parent / "static"
XSS_JOB = "<img src=x onerror=\"window.__xss='job'\">"
XSS_REASON = "</td><script>window.__xss='reason'</script>"
LIVE_LATENCY_S = 2.0  # the bound: a rank turns parked on the page within 2 s


# -- without a browser: headers, no data in the page, the config route ----------------


def test_the_page_and_its_assets_carry_no_data_and_a_strict_csp(broker):
    register(broker, "s1", job="secret-job-name", namespace="team-a")
    with broker.client() as c:
        for path in ("/", "/dashboard/app.js", "/dashboard/style.css"):
            response = c.get(path)
            assert response.status_code == 200, path
            csp = response.headers["content-security-policy"]
            assert "script-src 'self'" in csp and "default-src 'none'" in csp
            assert "unsafe-inline" not in csp and "http" not in csp
            assert response.headers["x-content-type-options"] == "nosniff"
            assert "secret-job-name" not in response.text and "s1" not in response.text.split()
        assert c.get("/dashboard/../app.py").status_code == 404
        assert c.get("/dashboard/keys.py").status_code == 404
        assert c.get("/v1/dashboard").status_code == 401
    with broker.client(AGENT) as c:
        assert c.get("/v1/dashboard").status_code == 403
    with broker.client(VIEWER) as c:
        config = c.get("/v1/dashboard").json()
    urgent = ["stalled", "parked", "killed", "failed", "lost"]
    assert config["states"][:5] == config["urgent"] == urgent
    assert "lost" in config["states"] and config["state_of_kind"]["parked"] == "parked"


def test_the_shipped_files_load_nothing_from_elsewhere_and_write_no_html():
    html = (STATIC / "index.html").read_text()
    scripts = [n for n in dashboard.FILES if n.endswith(".js")]
    assert set(re.findall(r'<script src="/dashboard/([^"]+)"', html)) == set(scripts)
    script = "\n".join((STATIC / name).read_text() for name in scripts)
    assert re.findall(r"<script[^>]*>([^<]+)</script>", html) == []  # no inline script
    assert " style=" not in html and "<style" not in html
    # SVG's namespace name is an identifier the DOM needs, never fetched
    script_urls = script.replace('"http://www.w3.org/2000/svg"', "SVG_NS")
    for text in (html, script_urls, (STATIC / "style.css").read_text()):
        assert "http://" not in text and "https://" not in text and "//cdn" not in text
    assert "innerHTML" not in script and "insertAdjacentHTML" not in script
    assert "document.write" not in script and "eval(" not in script
    assert "EventSource" not in script  # the stream is read with fetch: the token in a header


# -- in chromium --------------------------------------------------------------------


def test_without_a_token_the_page_asks_for_one_and_shows_no_data(broker, page):
    register(broker, "s1", job="secret-job-name")
    page.goto(broker.url + "/")
    page.wait_for_selector("#login:not([hidden]) #token")
    assert page.is_hidden("#main")
    assert "secret-job-name" not in page.content()
    page.fill("#token", "not-a-known-token")
    page.click("#login button[type=submit]")
    page.wait_for_selector("#login-error:has-text('token refused')")
    assert "secret-job-name" not in page.content()
    assert page.evaluate("sessionStorage.length + localStorage.length") == 0


def test_the_login_is_an_httponly_cookie_and_a_post_without_its_csrf_token_is_refused(broker, page):
    register(broker, "s-cookie", job="train-cookie", namespace="team-a")
    login(page, broker, ADMIN)
    page.wait_for_selector(".rank[data-session='s-cookie']")
    # the token is nowhere the page's scripts (or another script on it) could read
    assert page.evaluate("document.cookie") == ""
    assert page.evaluate("sessionStorage.length + localStorage.length") == 0
    assert ADMIN not in page.content() and ADMIN not in page.url
    cookies = {c["name"]: c for c in page.context.cookies()}
    login_cookie = cookies["breakpod_login"]
    assert login_cookie["httpOnly"] and login_cookie["sameSite"] == "Strict"
    # the cookie rides on a request the page makes; without the CSRF token it is refused
    send = """async (headers) => {
        const r = await fetch('/v1/sessions/s-cookie/commands', {method: 'POST',
            headers: {'Content-Type': 'application/json', ...headers},
            body: JSON.stringify({command: 'break'})});
        return r.status;
    }"""
    assert page.evaluate(send, {}) == 403
    assert page.evaluate(send, {"X-CSRF-Token": "guessed"}) == 403
    # a reload keeps the login (and gets its CSRF token back); log out ends it
    page.reload()
    page.wait_for_selector(".rank[data-session='s-cookie']")
    page.click("#logout")
    page.wait_for_selector("#login:not([hidden]) #token")
    assert page.evaluate("fetch('/v1/sessions').then(r => r.status)") == 401
    with httpx.Client(base_url=broker.url, cookies={"breakpod_login": login_cookie["value"]}) as c:
        assert c.get("/v1/sessions").status_code == 401  # a copied cookie is dead too


def test_ranks_appear_turn_parked_live_filter_and_escape_agent_text(broker, spawn, page):
    register(broker, "xss-1", token=AGENT2, job=XSS_JOB, namespace="team-b")
    with broker.client(AGENT2) as c:
        beat = c.post("/v1/sessions/xss-1/heartbeat", json={"reason": XSS_REASON})
        assert beat.status_code == 200, beat.text
    children = [spawn(LOOP, env=agent_env(broker, rank)) for rank in (0, 1)]
    ranks = wait_until(lambda: _by_rank(broker, "train-live", 2), timeout=30)

    started = login(page, broker)
    for session in ranks.values():
        page.wait_for_selector(f".rank[data-session='{session['id']}'][data-state='running']")
    first_data = time.perf_counter() - started
    in_page = int(page.evaluate("document.documentElement.dataset.firstDataMs"))
    page.evaluate("window.__sameDocument = true")
    watch_state(page, ranks[1]["id"], "parked")

    send(broker, ranks[1]["id"], "break")
    children[1].wait_for("break requested through the broker")
    shown_at = until(page, "window.__parkedAt") / 1000
    latency = shown_at - received(broker, ranks[1]["id"], "parked")
    print(f"\nfirst data {first_data * 1000:.0f} ms after goto ({in_page} ms in the page); ")
    print(f"agent event received -> parked on the page: {latency * 1000:.0f} ms")
    assert page.evaluate("window.__sameDocument") is True  # no reload
    assert 0 <= latency < LIVE_LATENCY_S, latency
    assert page.get_attribute(f".rank[data-session='{ranks[0]['id']}']", "data-state") == "running"
    assert page.get_attribute("article.job >> nth=0", "data-job") == "train-live"  # parked first

    _check_escaped(page)
    _check_filters(page)
    _check_attach(page, ranks[1]["id"])
    _check_states_it_does_not_know(page, ranks[0]["id"])
    send(broker, ranks[1]["id"], "resume")  # the loop then ends: running, then finished
    cell = f"document.querySelector(`.rank[data-session='{ranks[1]['id']}']`).dataset.state"
    until(page, f"['running', 'finished'].includes({cell})")


def _by_rank(broker, job, world_size):
    found = {s["rank"]: s for s in sessions(broker) if s["job"] == job}
    return found if len(found) == world_size else None


def _check_escaped(page):
    job = page.locator("article.job", has=page.locator(".job-name", has_text=XSS_JOB))
    assert job.locator(".job-name").text_content() == XSS_JOB
    assert job.locator("td.reason").text_content() == XSS_REASON
    assert page.locator("#jobs img, #jobs script").count() == 0
    assert page.evaluate("window.__xss") is None


def _check_filters(page):
    page.select_option("#f-namespace", "team-b")
    jobs_shown(page, 1)
    assert page.get_attribute("article.job", "data-namespace") == "team-b"
    page.select_option("#f-namespace", "")
    page.select_option("#f-state", "parked")
    jobs_shown(page, 1)
    assert page.get_attribute("article.job", "data-job") == "train-live"
    page.select_option("#f-state", "")
    page.fill("#f-job", "img src")
    jobs_shown(page, 1)
    assert page.get_attribute("article.job", "data-namespace") == "team-b"
    page.fill("#f-job", "")
    jobs_shown(page, 2)


def _check_attach(page, session_id):
    page.click(f".rank[data-session='{session_id}']")
    page.wait_for_selector(f"#detail .attach pre:has-text('breakpod attach {session_id}')")
    page.wait_for_selector("#detail .timeline li[data-kind='parked']")


def _check_states_it_does_not_know(page, session_id):
    """A protocol state added later ("waiting") has its colour; one the page has never
    heard of is drawn in the neutral colour under its own name, not its job's colour."""
    cell = f".rank[data-session='{session_id}']"
    colours = {}
    for state in ("waiting", "teleported"):
        # one JS turn: a live re-render (the agent keeps beating) cannot come in between
        shown, title, colour = page.evaluate(
            f"""() => {{
                app.sessions.get('{session_id}').state = '{state}';
                render();
                const e = document.querySelector("{cell}");
                return [e.dataset.state, e.title, getComputedStyle(e).backgroundColor];
            }}"""
        )
        assert shown == state and state in title
        colours[state] = colour
    assert colours == {"waiting": "rgb(161, 98, 7)", "teleported": "rgb(15, 118, 110)"}


def test_the_broker_serves_the_page_it_ships(broker):
    """The files the page names are the files in the package."""
    html = httpx.get(broker.url + "/", timeout=10).text
    for name in re.findall(r'(?:src|href)="/dashboard/([^"]+)"', html):
        assert (STATIC / name).is_file() and name in dashboard.FILES
