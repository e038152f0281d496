"""``make screenshots``: the dashboard rendered with fixture data to PNG, for the README.

    python -m tests.dashboard.screenshots [FOLDER]     (default: screenshots/, gitignored)

Starts a real Redis and broker on 127.0.0.1, registers a 4-rank job with one rank
parked on a NaN (its loss history and anomaly included, its hold counting down),
a stalled job whose report names its culprit, a failed job, one killed by its
memory limit, a parked one whose process was killed (lost), and a running one,
then drives Debian's chromium to write jobs.png, session.png and narrow.png (390 px).
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from breakpod_broker.redis_server import EmbeddedRedis
from tests.brokerkit import AGENT, VIEWER, BrokerProcess
from tests.dashboard.conftest import CHROMIUM, CHROMIUM_ARGS

JOB = "llama-finetune"
PARKED = f"{JOB}-r2"
SIZE = {"width": 1400, "height": 900}
TALL = {"width": 1400, "height": 2000}


def sessions() -> list[tuple[str, dict[str, Any]]]:
    job = [
        (
            f"{JOB}-r{r}",
            {
                "job": JOB,
                "namespace": "research",
                "rank": r,
                "world_size": 4,
                "pod": f"{JOB}-worker-{r}",
                "node": f"gpu-node-{r // 2}",
                "runtime": "kubernetes",
                "listener": "pdb",
                "address": "127.0.0.1:5678",
            },
        )
        for r in range(4)
    ]
    stalled = [
        (
            f"resnet-sweep-r{r}",
            {
                "job": "resnet-sweep",
                "namespace": "vision",
                "rank": r,
                "world_size": 2,
                "pod": f"resnet-sweep-{r}",
                "runtime": "kubernetes",
            },
        )
        for r in range(2)
    ]
    running = [
        (
            "bert-eval-r0",
            {
                "job": "bert-eval",
                "namespace": "nlp",
                "rank": 0,
                "world_size": 1,
                "pod": "bert-eval-0",
                "runtime": "kubernetes",
            },
        )
    ]
    ended = [
        (
            f"gpt-pretrain-r{r}",
            {
                "job": "gpt-pretrain",
                "namespace": "research",
                "rank": r,
                "world_size": 4,
                "pod": f"gpt-pretrain-{r}",
                "runtime": "kubernetes",
            },
        )
        for r in range(4)
    ]
    died = [
        (
            "vit-probe-r0",
            {
                "job": "vit-probe",
                "namespace": "vision",
                "rank": 0,
                "world_size": 1,
                "pod": "vit-probe-0",
                "runtime": "kubernetes",
            },
        ),
        (
            "sd-finetune-r0",
            {
                "job": "sd-finetune",
                "namespace": "vision",
                "rank": 0,
                "world_size": 1,
                "pod": "sd-finetune-0",
                "runtime": "kubernetes",
            },
        ),
    ]
    return job + stalled + running + ended + died


def events() -> list[dict[str, Any]]:
    found = []
    for step in range(1, 41):
        loss = "nan" if step == 40 else round(2.4 * 0.97**step + 0.02 * (step % 3), 4)
        found.append(
            _event(
                PARKED,
                f"log-{step}",
                "log",
                step=step,
                loss=loss,
                grad_norm=round(1.5 + 0.05 * step + (6.0 if step == 39 else 0), 3),
            )
        )
    found.append(
        _event(
            PARKED,
            "nan",
            "anomaly",
            rule="nonfinite",
            check="nonfinite",
            module="model.layers.17.mlp.down_proj",
            step=40,
            phase="backward",
            summary="gradient w.r.t. the input of model.layers.17.mlp.down_proj has "
            "non-finite values (nan=12 +inf=0 -inf=0)",
            value="nan",
            details={"nan": 12, "+inf": 0, "-inf": 0},
            also=[],
            skipped=False,
            held=True,
        )
    )
    found.append(
        _event(
            PARKED,
            "park",
            "parked",
            reason="anomaly: nonfinite at step 40",
            address="127.0.0.1:5678",
            backend="pdb",
            hold_until=time.time() + 1800,
        )
    )
    found += [
        _event(f"{JOB}-r{r}", "wait", "waiting", reason="rank 2 is parked") for r in (0, 1, 3)
    ]
    found.append(
        _event(
            "resnet-sweep-r1",
            "stall",
            "stall",
            seconds=312.0,
            step=1180,
            rank=1,
            state="collective",
            frame="train.py:88 in step",
            stacks="Thread MainThread\n  File train.py, line 88, in step\n    dist.all_reduce(t)",
        )
    )
    found.append(
        _event(
            "resnet-sweep-r0",
            "job-stall",
            "stall",
            scope="job",
            seconds=312.0,
            culprits=[1],
            ranks=[
                {
                    "rank": 0,
                    "step": 1181,
                    "state": "collective",
                    "entered": 2363,
                    "op": "allreduce",
                    "frame": "train.py:88 in step",
                },
                {
                    "rank": 1,
                    "step": 1180,
                    "state": "user",
                    "entered": 2361,
                    "frame": "data.py:41 in fetch_batch",
                },
            ],
        )
    )
    found.append(
        _event("gpt-pretrain-r3", "end", "finished", exit=1)
    )  # then torchrun stops the rest
    found += [_event(f"gpt-pretrain-r{r}", "end", "finished", signal=15) for r in (0, 1, 2)]
    found.append(_event("vit-probe-r0", "oom", "killed", reason="OOMKilled", exit=137))
    found.append(
        _event(
            "sd-finetune-r0",
            "park",
            "parked",
            reason="breakpoint() at train.py:210",
            address="127.0.0.1:5678",
            backend="pdb",
        )
    )
    return found


def _event(session: str, name: str, kind: str, **fields: Any) -> dict[str, Any]:
    return {"id": f"{session}-{name}", "session": session, "kind": kind, "fields": fields}


def load(broker: BrokerProcess) -> None:
    with httpx.Client(
        base_url=broker.url, headers={"Authorization": f"Bearer {AGENT}"}, timeout=30
    ) as c:
        for sid, doc in sessions():
            c.put(f"/v1/sessions/{sid}", json=doc).raise_for_status()
        c.post("/v1/events", json={"events": events()}).raise_for_status()
    import redis  # the process that parked was killed: its heartbeats stop

    with redis.Redis.from_url(broker.redis_url) as r:
        r.delete("breakpod:alive:{sd-finetune-r0}")


def shoot(url: str, folder: Path) -> list[Path]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        page = browser.new_context(viewport=SIZE).new_page()
        page.goto(url + "/")
        page.fill("#token", VIEWER)
        page.click("#login button[type=submit]")
        page.wait_for_selector(f".rank[data-session='{PARKED}'][data-state=parked]")
        jobs = folder / "jobs.png"
        page.screenshot(path=str(jobs), full_page=True)
        page.set_viewport_size(TALL)  # the session panel is as tall as the window
        page.click(f".rank[data-session='{PARKED}']")
        page.wait_for_selector("#detail svg.plot[data-series=loss]")
        page.wait_for_selector("#detail .attach")
        session = folder / "session.png"
        page.screenshot(path=str(session), full_page=True)
        page.keyboard.press("Escape")
        page.set_viewport_size({"width": 390, "height": 844})
        page.wait_for_selector("#detail", state="hidden")
        narrow = folder / "narrow.png"
        page.screenshot(path=str(narrow), full_page=False)
        browser.close()
    return [jobs, session, narrow]


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else "screenshots")
    if not CHROMIUM.exists():
        print(f"no {CHROMIUM}: apt-get install -y chromium", file=sys.stderr)
        return 1
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        redis = EmbeddedRedis(Path(tmp)).start()
        broker = BrokerProcess(
            redis.url, Path(tmp) / "broker.log", BREAKPOD_HEARTBEAT_TTL_SECONDS="3600"
        )
        try:
            broker.start()
            load(broker)
            for path in shoot(broker.url, folder):
                print(path)
        finally:
            broker.stop()
            redis.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
