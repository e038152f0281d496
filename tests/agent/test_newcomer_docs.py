"""The user guide: a short README that starts with the two commands, the rest in
docs/ (every former section still there), a settings page generated from the code
that a test keeps fresh, and a README training loop that really parks on NaN."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.agent.test_attach_cli import run_cli

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MOVED_SECTIONS = [  # every section title of the former long README, now under docs/
    "Breakpoints that park instead of dying",
    "Listeners ready before anything goes wrong",
    "Post-mortem on crashes",
    "Stalls: where is the job stuck, and which rank is to blame?",
    "torchrun and other multi-process launchers",
    "One rank parks, the whole job waits",
    "Security",
    "Settings",
    "Latency (`make bench`, `bench/pdb_latency.py`)",
    "Tensor monitors",
    "Rules file",
    "Anomalies and localization",
    "Actions",
    "pdb commands",
    "torch.compile",
    "No host sync on the hot path",
    "Cost (`make bench`, `bench/monitors.py`)",
    "Broker",
    "Dashboard",
    "CI: attach to a failed test or run",
    "pytest: `--breakpod`",
    "Reaching the held container",
    "`breakpod run`",
    "`breakpod doctor`",
    "Deploying: Docker, compose and Helm",
    "Images (`docker/`)",
    "Compose",
    "Helm chart (`helm/breakpod`)",
    "Security defaults (chart and compose)",
    "The debug overlay in your own chart",
    "The admission webhook",
    "Tests",
]


def headings() -> set[str]:
    found = set()
    for page in (ROOT / "docs").glob("*.md"):
        fence = False
        for line in page.read_text().splitlines():
            fence ^= line.startswith("```")
            if not fence and line.startswith("#"):
                found.add(line.lstrip("#").strip())
    return found


def test_the_readme_is_short_and_starts_with_the_two_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 180
    top = "\n".join(lines[:15])
    assert "make demo" in top and "make test" in top


def test_every_former_section_lives_on_under_docs():
    missing = [title for title in MOVED_SECTIONS if title not in headings()]
    assert missing == []


def test_the_readme_links_point_at_pages_that_exist():
    for target in re.findall(r"\]\(([^)#]+)", README.read_text()):
        assert (ROOT / target).exists(), target


def test_the_settings_page_is_fresh():
    check = subprocess.run(
        [sys.executable, str(ROOT / "docs" / "gen_settings.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert check.returncode == 0, check.stderr


def test_the_settings_page_names_every_setting_the_code_reads():
    from breakpod._core import config
    from breakpod_broker.settings import ENV_PREFIX, BrokerSettings

    page = (ROOT / "docs" / "settings.md").read_text()
    names = [*config.ENV.values(), *config.OTHER_ENV, *config.FEATURE_ENV]
    names += [f"{ENV_PREFIX}{field.upper()}" for field in BrokerSettings.model_fields]
    assert [name for name in names if f"`{name}`" not in page] == []


def test_every_breakpod_variable_the_agent_spells_is_on_the_settings_page():
    """A variable read anywhere in the agent (as a string literal) is a setting a user
    can meet: it must be in one of the tables the page is generated from."""
    page = (ROOT / "docs" / "settings.md").read_text()
    spelled = set()
    for path in (ROOT / "agent" / "src" / "breakpod").rglob("*.py"):
        spelled.update(re.findall(r"[\"'](BREAKPOD_[A-Z_]+)[\"']", path.read_text()))
    assert len(spelled) > 20  # the scan finds what it looks for
    assert sorted(name for name in spelled if f"`{name}`" not in page) == []


def test_the_package_readmes_say_how_to_install_and_use_them():
    for package, command in (("agent", "breakpod attach"), ("broker", "breakpod-broker serve")):
        text = (ROOT / package / "README.md").read_text()
        assert len(text.splitlines()) >= 20 and "pip install" in text and command in text


def readme_example() -> str:
    text = README.read_text()
    section = text.split("## A training loop that parks on NaN", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.timeout(120)
def test_the_readme_training_loop_parks_on_nan_and_continues(spawn):
    pytest.importorskip("torch")
    example = readme_example()
    assert len(example.strip().splitlines()) <= 12
    child = spawn(example + "print('done', step, flush=True)\n", stdin="closed")
    port = child.park_port(timeout=60)
    assert "nonfinite" in child.stderr
    attached = run_cli("attach", f"127.0.0.1:{port}", stdin="p step\nc\n", timeout=60)
    assert attached.returncode == 0, attached.stderr
    assert "7" in attached.stdout
    assert child.wait(timeout=60) == 0
    assert "done 19" in child.stdout()


def test_the_culprit_line_reads_as_the_docs_write_it():
    from breakpod._job.stall_report import culprits

    level = {"state": "collective", "entered": 5, "step": 5}
    behind = {"state": "user", "entered": 4, "step": 5}
    _, three = culprits({0: level, 1: level, 2: behind})
    _, two = culprits({0: level, 1: behind})
    assert three == "not in collective #5 that ranks 0, 1 wait in"
    assert two == "not in collective #5 that rank 0 waits in"
    guide = (ROOT / "docs" / "many-ranks.md").read_text()
    assert f"culprit: rank 2 (step 5, {three})" in guide and "that rank 0 waits in" in guide


STALLED_ONCE = """
    import time
    import breakpod
    for i in range(12):
        breakpod.step(i)
        time.sleep(2.0 if i == 5 else 0.02)
"""


@pytest.mark.timeout(60)
def test_the_stall_over_line_of_a_process_is_the_docs_line(spawn):
    child = spawn(STALLED_ONCE, env={"BREAKPOD_STALL_AFTER": "0.5"})
    assert child.wait(timeout=30) == 0, child.stderr
    said = re.search(r"stall over: stepping again at step \d+", child.stderr)
    assert said is not None, child.stderr
    guide = " ".join((ROOT / "docs" / "many-ranks.md").read_text().split())
    assert "`stall over: stepping again at step N`" in guide
    assert "`stall over: every rank is stepping again`" in guide


def test_the_docs_say_what_registers_a_process_without_a_park():
    readme = " ".join(README.read_text().split())
    monitors = " ".join((ROOT / "docs" / "monitors.md").read_text().split())
    for text in (readme, monitors):
        assert "without a park" in text and "first `breakpod.step()`" in text
        assert "`breakpod.watch(model)`" in text
