"""A session's view in real chromium: the anomaly, the stall report and the plots,
from events a real broker stored (posted as an agent would send them)."""

from __future__ import annotations

from typing import Any

from tests.brokerkit import post_events, register

XSS_MODULE = "<img src=x onerror=\"window.__xss='module'\">"
XSS_SUMMARY = "</p><script>window.__xss='summary'</script>"
XSS_RULE = "<svg onload=\"window.__xss='rule'\">"
XSS_KEY = "<b onmouseover=\"window.__xss='key'\">k</b>"


def event(session: str, n: int, kind: str, **fields: Any) -> dict[str, Any]:
    return {"id": f"{session}-{kind}-{n}", "session": session, "kind": kind, "fields": fields}


def open_session(page: Any, broker: Any, session_id: str) -> None:
    from tests.dashboard.pagekit import login

    login(page, broker)
    page.click(f".rank[data-session='{session_id}']")
    page.wait_for_selector("#detail:not([hidden]) .timeline li", state="attached")


def test_an_anomaly_shows_its_rule_module_step_and_summary_as_text(broker, page):
    register(broker, "nan-1", job="train-nan", rank=0, world_size=1)
    anomaly = event(
        "nan-1",
        1,
        "anomaly",
        rule=XSS_RULE,
        also=["loss_nonfinite"],
        check="nonfinite",
        module=XSS_MODULE,
        step=41,
        phase="backward",
        summary=XSS_SUMMARY,
        value="nan",
        details={"nan": 3, "+inf": 1, "-inf": 0, XSS_KEY: "<i>v</i>"},
        skipped=False,
        held=True,
    )
    parked = event("nan-1", 2, "parked", reason="anomaly at step 41", address="127.0.0.1:5678")
    assert post_events(broker, anomaly, parked).status_code == 200

    open_session(page, broker, "nan-1")
    section = page.locator("#detail section.anomaly")
    section.wait_for()
    assert section.locator(".summary").text_content() == XSS_SUMMARY
    assert section.locator("dd[data-fact=module]").text_content() == XSS_MODULE
    assert section.locator("dd[data-fact=rule]").text_content() == f"{XSS_RULE}, loss_nonfinite"
    assert section.locator("dd[data-fact=step]").text_content() == "41"
    assert section.locator("dd[data-fact=phase]").text_content() == "backward"
    assert section.locator("dd[data-fact=value]").text_content() == "nan"
    rows = section.locator("table.details tr")
    assert rows.nth(3).locator("th").text_content() == XSS_KEY
    assert rows.nth(3).locator("td").text_content() == "<i>v</i>"
    by_module = section.locator("table.nonfinite-modules tr").nth(1)
    assert by_module.locator("td").all_text_contents() == [XSS_MODULE, "41", "nan=3 +inf=1"]
    # nothing the agent wrote became markup: no element of those tags, no script ran
    assert page.locator("#detail img, #detail script, #detail b, #detail i").count() == 0
    assert page.locator("#detail svg:not(.plot)").count() == 0
    assert page.evaluate("window.__xss") is None
    # no section left out of this view is written as the word "null" instead
    assert "null" not in page.evaluate(
        "[...document.getElementById('detail').childNodes].filter(n => n.nodeType === 3)"
        ".map(n => n.textContent).join(' ')"
    )


def test_the_plots_mark_nan_and_inf_points_and_drop_none(broker, page):
    register(broker, "plot-1", job="train-plot", rank=0, world_size=1)
    losses: dict[int, Any] = {s: 2.0 - s * 0.05 for s in range(1, 21)}
    losses.update({7: "nan", 12: "inf", 15: "-inf"})
    logs = [event("plot-1", s, "log", step=s, loss=v, grad_norm=1.0 + s) for s, v in losses.items()]
    spike = event(
        "plot-1",
        0,
        "anomaly",
        rule="loss_spike",
        check="loss_spike",
        phase="loss",
        module="",
        step=21,
        value=123.0,
        summary="loss 123 is 70x the median",
    )
    history = event("plot-1", 99, "log", history={"grad_norm": [[22, "nan"], [23, 4.5]]})
    assert post_events(broker, *logs, spike, history).status_code == 200

    open_session(page, broker, "plot-1")
    loss = page.locator("#detail svg.plot[data-series=loss]")
    loss.wait_for()
    # every step is drawn: 20 logged + the anomaly's own loss at step 21
    assert loss.locator(".point").count() == 21
    marked = loss.locator(".point.nonfinite")
    assert {
        (m.get_attribute("data-step"), m.get_attribute("data-value")) for m in marked.all()
    } == {
        ("7", "nan"),
        ("12", "inf"),
        ("15", "-inf"),
    }
    assert loss.locator("circle.point.anomaly[data-step='21']").count() == 1
    assert loss.locator("line.anomaly-step").count() == 1
    # a non-finite point breaks the line: 1-6, 8-11, 13-14, 16-21
    assert loss.locator("polyline.line").count() == 4
    top = float(loss.locator(".point.nonfinite[data-value=nan]").evaluate("p => p.points[2].y"))
    bottom = float(
        loss.locator(".point.nonfinite[data-value='-inf']").evaluate("p => p.points[2].y")
    )
    assert top < bottom  # nan on the top edge, -inf on the bottom one
    caption = page.locator("#detail .plots figcaption").first.text_content()
    assert "21 step(s)" in caption and "3 non-finite" in caption

    grads = page.locator("#detail svg.plot[data-series=grad_norm]")
    assert grads.locator(".point").count() == 22  # 20 logged + 2 from the history field
    assert grads.locator(".point.nonfinite[data-step='22'][data-value=nan]").count() == 1


def test_metrics_named_like_object_members_are_plotted_not_a_blank_view(broker, page):
    """An agent names its metrics: "constructor" or "__proto__" are names like any other,
    and a history that is not a list of points is left out, not a broken view."""
    register(broker, "proto-1", job="train-proto", rank=0, world_size=1)
    history = {"constructor": [[1, 2.0], [2, 3.0]], "__proto__": [[1, 1.0]], "toString": 5}
    odd = event("proto-1", 1, "log", history=history)
    anomaly = event("proto-1", 2, "anomaly", check="constructor", step=3, value=1.0, summary="s")
    assert post_events(broker, odd, anomaly).status_code == 200

    open_session(page, broker, "proto-1")
    page.locator("#detail section.anomaly").wait_for()
    plots = page.locator("#detail svg.plot")
    assert sorted(plots.evaluate_all("ps => ps.map(p => p.dataset.series)")) == [
        "__proto__",
        "constructor",
    ]
    assert page.locator("#detail svg.plot[data-series=constructor] .point").count() == 2


def test_a_job_stall_names_the_culprit_and_folds_the_stacks(broker, page):
    register(broker, "stall-0", job="train-stall", rank=0, world_size=3)
    ranks = [
        {
            "rank": r,
            "step": 80 if r != 2 else 79,
            "state": "collective" if r != 2 else "user",
            "op": "all_reduce",
            "entered": 160,
            "completed": 159,
            "silent": 31.0,
            "frame": "train.py:42 in step" if r != 2 else "data.py:7 in load",
        }
        for r in range(3)
    ]
    stall = event(
        "stall-0",
        1,
        "stall",
        scope="job",
        seconds=31.0,
        culprits=[2],
        ranks=ranks,
        culprit_stacks={"2": "Thread main\n  File data.py, line 7, in load\n    q.get()"},
        report="job stall: rank 2 is behind",
    )
    assert post_events(broker, stall).status_code == 200

    open_session(page, broker, "stall-0")
    section = page.locator("#detail section.stall[data-scope=job]")
    section.wait_for()
    assert "culprit rank 2" in section.locator(".culprit").first.text_content()
    rows = section.locator("table.stall-ranks tr[data-rank]")
    assert rows.count() == 3
    assert section.locator("tr.culprit").get_attribute("data-rank") == "2"
    assert "data.py:7 in load" in section.locator("tr.culprit").text_content()
    stacks = section.locator("details", has=page.locator("summary", has_text="stacks of rank 2"))
    assert stacks.get_attribute("open") is None  # folded
    stacks.locator("summary").click()
    assert "q.get()" in stacks.locator("pre").inner_text()
    # a live re-render keeps the fold open
    post_events(broker, event("stall-0", 2, "log", message="still stuck"))
    page.wait_for_selector("#detail .timeline li[data-kind=log]", state="attached")  # folded
    assert stacks.get_attribute("open") is not None
    # these events carry no per-step values: the plots say so
    assert "no per-step values" in page.locator("#detail .plots p").text_content()


def test_the_flight_recorder_dump_an_event_carried_is_a_table_of_text(broker, page):
    register(broker, "fl-1", job="train-fl", rank=0, world_size=1)
    dump = {
        "steps": [0, 57],
        "kept": 58,
        "watched": 7,
        "first_bad": [
            {"module": XSS_MODULE, "phase": "forward", "step": 57, "why": "nan",
             "trend_steps": [55, 56, 57], "rms": [1.1234, 1.13, "nan"], "max_abs": [2, 2, "nan"]},
            {"module": "", "phase": "loss", "step": 57, "why": "nan",
             "trend_steps": [56, 57], "rms": [1.39, "nan"], "max_abs": [1.39, "nan"]},
        ],
        "more": 3,
    }  # fmt: skip
    anomaly = event("fl-1", 1, "anomaly", rule="nan", module="shifted", step=57, flight=dump)
    assert post_events(broker, anomaly).status_code == 200

    open_session(page, broker, "fl-1")
    section = page.locator("#detail section.flight")
    section.wait_for()
    assert section.locator(".summary").text_content() == (
        "steps 0-57 (58 kept), 7 watched tensors; from its anomaly event"
    )
    assert "(3 more not shown)" in section.locator("caption").text_content()
    rows = section.locator("table.flight-first-bad tr")
    assert rows.nth(1).locator("td").all_text_contents() == [
        XSS_MODULE, "forward", "57", "nan", "1.12 1.13 nan"
    ]  # fmt: skip
    assert rows.nth(2).locator("td").all_text_contents()[:2] == ["<model>", "loss"]
    assert page.locator("#detail img").count() == 0 and page.evaluate("window.__xss") is None
