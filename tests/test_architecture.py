"""The layout the design promises, checked from the code itself.

* No import circles: from each package's own imports (grimp reads them all,
  those deferred into functions and those under TYPE_CHECKING included).
* Layers: a module imports only from its own layer or the ones below it
  (the lists below are the design; change them with the design). The agent's
  layers are its packages.
* Every import is one grimp sees: no breakpod module is imported or looked up by
  name at run time, but by the public face's lazy names.
* A setting's way down: ``init_remote_debugger``'s port reaches the bind without
  a round trip at every module it passes.
* One protocol: no string of the agent/broker protocol (event kinds, states,
  commands, runtimes, listeners, API paths) is spelled outside
  ``breakpod/protocol.py``; docstrings may name them.

Each check is a function of a package: the broker and the agent are checked by
the same code.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

grimp = pytest.importorskip("grimp", reason="pip install -r requirements-dev.txt")

from breakpod import protocol  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
BROKER_SRC = ROOT / "broker" / "src" / "breakpod_broker"
AGENT_SRC = ROOT / "agent" / "src" / "breakpod"

# Top to bottom. independent=False: the modules of that layer may import each other
# (the no-cycle test still holds among them).
BROKER_LAYERS = (
    grimp.Layer("cli"),
    grimp.Layer("serving"),  # uvicorn: TLS, shutdown
    grimp.Layer("app", "admission"),  # the two ASGI apps
    grimp.Layer("fastpath"),  # heartbeat, command poll and event ingest below FastAPI's routing
    grimp.Layer("docker_watch", "pod_watch"),  # why a process died, from its runtime
    grimp.Layer("deaths", "reasons"),  # what the broker records itself: deaths and their reasons
    grimp.Layer(
        *("admin", "attach", "commands", "dashboard", "events", "listing", "sessions"),
        "joblog",  # the job-wide command log that sessions and commands share
        independent=False,
    ),  # routes
    grimp.Layer("auth"),  # FastAPI dependencies: token and role checks
    grimp.Layer("logins", "stalls"),  # dashboard logins; a job stall's culprit on its ranks
    grimp.Layer("context"),  # what every request handler gets
    grimp.Layer(
        *("notifiers", "metrics", "redis_server", "overlay", "fanout", "wakeups"),
        *("redis_clients", "sharded", "liveness"),
        independent=False,
    ),
    grimp.Layer(
        *("models", "scripts", "tokens", "settings", "limits", "keys", "errors", "proxies"),
        independent=False,
    ),
)


# The agent's layers (ARCHITECTURE.md draws them), top to bottom: each is a package
# (or a module at the top of ``breakpod``), so the folders are the layers and a module
# moved or added inside one needs no change here. Within a layer of several, the
# upper may import the lower (independent=False); the no-circle test covers them all.
AGENT_LAYERS = (
    grimp.Layer("_integrations"),  # entered from outside: pytest, the .pth, Jupyter
    grimp.Layer("_cli"),  # the console script
    # the public toolkit and the entry points that compose the layers below
    grimp.Layer("export", "health", "_api", independent=False),
    grimp.Layer("_link"),  # the link to the broker: client, emitter, the commands it runs
    grimp.Layer("_monitor"),  # tensor monitors, time travel, the flight recorder
    grimp.Layer("_job"),  # the step boundary, the stall watchdog, the job's ranks
    grimp.Layer("_debug"),  # parks, breakpoints, listeners, remote pdb
    grimp.Layer("_core", "protocol", independent=False),  # hub, settings, errors; the wire
)

# -- import graph -------------------------------------------------------------


def find_cycle(package: str) -> list[str] | None:
    """One import circle among ``package``'s modules (first module repeated last), or None."""
    graph = grimp.build_graph(package)
    imports = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    done: set[str] = set()
    for start in sorted(imports):
        cycle = _cycle_from(start, imports, done)
        if cycle is not None:
            return cycle
    return None


def _cycle_from(start: str, imports: dict[str, list[str]], done: set[str]) -> list[str] | None:
    """Iterative depth-first search; ``done`` holds modules known to reach no circle."""
    path: list[str] = []
    on_path: set[str] = set()
    stack: list[tuple[str, Iterator[str]]] = []

    def enter(module: str) -> None:
        path.append(module)
        on_path.add(module)
        stack.append((module, iter(imports.get(module, ()))))

    if start not in done:
        enter(start)
    while stack:
        module, pending = stack[-1]
        child = next(pending, None)
        if child is None:
            stack.pop()
            on_path.discard(path.pop())
            done.add(module)
        elif child in on_path:
            return [*path[path.index(child) :], child]
        elif child not in done:
            enter(child)
    return None


def layer_violations(package: str, layers: Iterable[grimp.Layer]) -> list[str]:
    """Imports that point up, between the layers named by their tails in ``package``."""
    graph = grimp.build_graph(package)
    illegal = graph.find_illegal_dependencies_for_layers(layers=tuple(layers), containers={package})
    return sorted(
        f"{' | '.join(sorted(route.heads))} -> {' -> '.join(route.middle) or '.'} -> "
        f"{' | '.join(sorted(route.tails))} ({dep.importer} sits below {dep.imported})"
        for dep in illegal
        for route in dep.routes
    )


@pytest.mark.parametrize("package", ["breakpod_broker", "breakpod"])
def test_no_import_circles(package: str) -> None:
    cycle = find_cycle(package)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


def test_broker_layers_point_down_only() -> None:
    assert layer_violations("breakpod_broker", BROKER_LAYERS) == []


def test_agent_layers_point_down_only() -> None:
    assert layer_violations("breakpod", AGENT_LAYERS) == []


def test_broker_layer_list_names_every_module() -> None:
    """A new module must be placed in a layer, or the layer test would not see it."""
    named = {f"breakpod_broker.{tail}" for layer in BROKER_LAYERS for tail in layer.module_tails}
    assert _plain_modules("breakpod_broker") == named


def test_agent_layer_list_names_every_package() -> None:
    """Each package (and module) at the top of ``breakpod`` sits in a layer."""
    graph = grimp.build_graph("breakpod")
    named = {f"breakpod.{tail}" for layer in AGENT_LAYERS for tail in layer.module_tails}
    assert graph.find_children("breakpod") == named


def _plain_modules(package: str) -> set[str]:
    """The package's modules, its (sub)packages left out: layers hold modules."""
    graph = grimp.build_graph(package)
    return {m for m in graph.modules if not graph.find_children(m)}


def test_the_graph_checks_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A circle (one import deferred into a function) and an upward import are found."""
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def later():\n    from circled import high\n")
    (package / "high.py").write_text("from circled import low\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert find_cycle("circled") in (
        ["circled.high", "circled.low", "circled.high"],
        ["circled.low", "circled.high", "circled.low"],
    )
    assert layer_violations("circled", [grimp.Layer("high"), grimp.Layer("low")]) != []
    assert layer_violations("breakpod_broker", reversed(BROKER_LAYERS)) != []
    assert layer_violations("breakpod", reversed(AGENT_LAYERS)) != []


def test_the_broker_takes_only_the_protocol_from_the_agent() -> None:
    graph = grimp.build_graph("breakpod_broker", "breakpod")
    used = {
        imported
        for importer in graph.find_children("breakpod_broker") | {"breakpod_broker"}
        for imported in graph.find_modules_directly_imported_by(importer)
        if imported.split(".")[0] == "breakpod"
    }
    assert used == {"breakpod.protocol"}


def test_the_protocol_is_standard_library_only() -> None:
    tree = ast.parse((AGENT_SRC / "protocol.py").read_text())
    imported = {
        alias.name for n in ast.walk(tree) if isinstance(n, ast.Import) for alias in n.names
    }
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    tops = {name.split(".")[0] for name in imported}
    assert tops <= set(sys.stdlib_module_names) | {"__future__"}


HTTP_MODULES = frozenset({"http.client", "urllib.request", "httpx", "requests", "aiohttp"})


def http_importers(root: Path) -> set[str]:
    """Files under ``root`` that import an HTTP client library (a relative path each)."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module:  # `from urllib import request` too
                names |= {n.module, *(f"{n.module}.{a.name}" for a in n.names)}
        if any(name == m or name.startswith(f"{m}.") for name in names for m in HTTP_MODULES):
            found.add(path.relative_to(root.parent).as_posix())
    return found


def test_the_broker_client_is_the_only_http_code_in_the_agent(tmp_path: Path) -> None:
    assert http_importers(AGENT_SRC) == {"breakpod/_link/client.py"}
    (tmp_path / "cli.py").write_text("from urllib import request\n")  # the scan can fail
    assert http_importers(tmp_path) == {f"{tmp_path.name}/cli.py"}


# -- imports by name ------------------------------------------------------------

# Where a breakpod module may be imported by name: the public face's lazy names.
BY_NAME_ALLOWED = {("breakpod/__init__.py", "__getattr__")}
BY_NAME_ALLOWED.add(("breakpod/__init__.py", "load_ipython_extension"))  # %load_ext breakpod


def imports_by_name(root: Path) -> list[str]:
    """``file:line in function`` for each breakpod module imported or looked up by name
    at run time (``importlib.import_module``, ``__import__``, ``sys.modules``): an
    import grimp cannot see, which would hide an arrow pointing up or a circle."""
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root.parent).as_posix()
        tree = ast.parse(path.read_text(), str(path))
        for function, node in _nodes_with_function(tree):
            if (where, function) not in BY_NAME_ALLOWED and _by_name(node):
                found.append((where, getattr(node, "lineno", 0), function))
    return [f"{where}:{line} in {function}" for where, line, function in sorted(found)]


def _nodes_with_function(tree: ast.AST) -> Iterator[tuple[str, ast.AST]]:
    """Every node, with the name of the function that holds it ("" at module level)."""
    stack: list[tuple[str, ast.AST]] = [("", tree)]
    while stack:
        function, node = stack.pop()
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        yield function, node
        stack.extend((function, child) for child in ast.iter_child_nodes(node))


def _by_name(node: ast.AST) -> bool:
    """An import or a ``sys.modules`` lookup of a breakpod module named by a string."""
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name in ("importlib.import_module", "import_module", "__import__"):
            return any(_names_breakpod(arg) for arg in node.args[:1])
        if name.startswith("sys.modules."):  # .get, .pop, .setdefault
            return any(_names_breakpod(arg) for arg in node.args[:1])
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) == "sys.modules":
        return _names_breakpod(node.slice)
    if isinstance(node, ast.Compare) and any(
        ast.unparse(c) == "sys.modules" for c in node.comparators
    ):
        return _names_breakpod(node.left)
    return False


def _names_breakpod(node: ast.AST) -> bool:
    """A string (or the f-string's head) that names breakpod or one of its modules."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    if isinstance(node, ast.Name):
        return node.id in ("__name__", "__package__")
    if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
        return False
    return node.value.partition(".")[0] == "breakpod"


def test_no_breakpod_module_is_imported_by_name() -> None:
    """Each import is one grimp sees, so the layer and circle checks see every arrow;
    only the public face looks its lazy names up by name."""
    assert imports_by_name(AGENT_SRC) == []


def test_the_by_name_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    package = tmp_path / "breakpod"
    package.mkdir()
    (package / "low.py").write_text(
        "import importlib, sys\n"
        "def later():\n"
        "    importlib.import_module('breakpod._monitor.x')\n"
        "    return sys.modules.get(f'breakpod.{1}'), 'breakpod.y' in sys.modules\n"
        "def fine():\n"
        "    return sys.modules['torch'], importlib.import_module('IPython.display')\n"
    )
    (package / "__init__.py").write_text(  # the face's lazy names may
        "import importlib\n"
        "def __getattr__(n):\n    return importlib.import_module(f'breakpod.{n}')\n"
    )
    assert imports_by_name(package) == [
        "breakpod/low.py:3 in later",
        "breakpod/low.py:4 in later",
        "breakpod/low.py:4 in later",
    ]


# -- a setting's way down ------------------------------------------------------

# ``init_remote_debugger(port=P)`` to the bind of P, in a process of its own (the
# listener is process-wide): every breakpod module the call path enters, and each
# return into a different module, a climb back up (a round trip the value makes).
PORT_PATH = """
import json, os, socket, sys
for name in ("LOCAL_RANK", "BREAKPOD_PORT", "BREAKPOD_HOST", "BREAKPOD_BROKER_URL", "WORLD_SIZE"):
    os.environ.pop(name, None)
from breakpod._api import init_remote_debugger
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
entered, climbs, bound = [], [], False
def profile(frame, event, arg):
    global bound
    name = frame.f_globals.get("__name__", "")
    caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back else ""
    if bound or not name.startswith("breakpod"):
        return
    if event == "call":
        entered.append(name)
        bound = name == "breakpod._core.net" and frame.f_code.co_name == "bind"
        assert not bound or port in frame.f_locals.values(), "bound another port"
    elif event == "return" and caller.startswith("breakpod") and caller != name:
        climbs.append(f"{name} -> {caller}")
sys.setprofile(profile)
init_remote_debugger(port=port, enable=True, backend="pdb")
sys.setprofile(None)
print(json.dumps({"bound": bound, "modules": sorted(set(entered)), "climbs": climbs}))
"""


def follow_the_port() -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-c", PORT_PATH],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
    )
    assert run.returncode == 0, run.stderr
    found: dict[str, Any] = json.loads(run.stdout)
    return found


def test_the_port_reaches_the_bind_in_fewer_climbs_than_modules() -> None:
    """The bind is validated once and the arguments are read where the settings are
    built, so the port goes down without a round trip at every module (before: 7
    modules, 8 climbs: the bind checked twice, each argument parsed on its own)."""
    path = follow_the_port()
    assert path["bound"], path
    assert len(path["climbs"]) < len(path["modules"]), path


# -- protocol strings -----------------------------------------------------------


def protocol_strings() -> dict[str, str]:
    """Every protocol value that must be spelled only in protocol.py -> what it is."""
    groups = {
        "event kind": protocol.EVENT_KINDS,
        "session state": (*protocol.STATES, protocol.LOST),
        "command": protocol.COMMANDS,
        "runtime": protocol.RUNTIMES,
        "listener": protocol.LISTENERS,
    }
    return {value: what for what, values in groups.items() for value in values}


# Where strings go on the wire, relative to each source root: every string there is
# checked. Elsewhere only what an event carries is (the kind and the field values of
# each ``emit(...)``): a rule action ``break`` or pdb's quit mode ``detach`` is
# another vocabulary that happens to share a word, and never leaves the process.
WIRE = {
    BROKER_SRC: ("",),  # the service: its routes, models, Redis records and notifiers
    AGENT_SRC: ("_link/", "_cli/broker.py"),  # the link to the broker; the CLI's calls
}


def spelled_protocol_strings(root: Path, allowed: set[str], wire: Iterable[str]) -> list[str]:
    """``file:line: 'text' (what)`` for each protocol value or API path spelled under
    ``root`` (but in the files named in ``allowed``): any string in the files under the
    ``wire`` prefixes, elsewhere the strings an ``emit(...)`` puts in its event.
    Docstrings and comments may name them; dictionary keys and subscripts name fields."""
    values = protocol_strings()
    found = []
    for path in sorted(root.rglob("*.py")):
        where = path.relative_to(root).as_posix()
        if where in allowed:
            continue
        tree = ast.parse(path.read_text(), str(path))
        on_wire = any(where.startswith(prefix) for prefix in wire)
        for node in _code_strings(tree) if on_wire else _emitted_strings(tree):
            what = values.get(node.value) or ("API path" if _is_api_path(node.value) else None)
            if what:
                found.append(
                    f"{path.relative_to(root.parent)}:{node.lineno}: {node.value!r} ({what})"
                )
    return found


def _emitted_strings(tree: ast.AST) -> Iterator[ast.Constant]:
    """The string constants an ``emit(...)`` call passes: its kind and field values."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "emit":
            for arg in [*node.args, *(k.value for k in node.keywords)]:
                if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                    yield arg


def _is_api_path(text: str) -> bool:
    return text == protocol.API or f"{protocol.API}/" in text


def _code_strings(tree: ast.AST) -> Iterator[ast.Constant]:
    skipped = {id(doc) for doc in _docstrings(tree)}
    skipped |= {id(k) for n in ast.walk(tree) if isinstance(n, ast.Dict) for k in n.keys if k}
    skipped |= {id(n.slice) for n in ast.walk(tree) if isinstance(n, ast.Subscript)}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in skipped
        ):
            yield node


def _docstrings(tree: ast.AST) -> Iterator[ast.AST]:
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and node.body
        ):
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                yield first.value


@pytest.mark.parametrize(
    ("root", "protocol_module"), [(BROKER_SRC, set()), (AGENT_SRC, {"protocol.py"})]
)
def test_no_protocol_string_is_spelled_outside_the_protocol(
    root: Path, protocol_module: set[str]
) -> None:
    assert spelled_protocol_strings(root, protocol_module, WIRE[root]) == []


def test_the_string_scan_finds_what_it_looks_for(tmp_path: Path) -> None:
    """The scan itself: it must be able to fail, on the wire and in an event."""
    (tmp_path / "routes.py").write_text(
        '"""Docstrings may say parked and /v1/sessions."""\n'
        'STATE = {"parked": "attached"}\n'  # the key names a field; the value is a state
        'PATH = f"/v1/sessions/{1}"\n'
        'NOT_PROTOCOL = "parking"\n'
        'FIELD = event["command"]\n'  # a subscript names a field
    )
    (tmp_path / "rules.py").write_text(
        'ACTIONS = ("break", "log")\n'  # another vocabulary, off the wire
        'events.emit("anomaly", why="break")\n'  # but what an event carries is on it
    )
    (tmp_path / "protocol.py").write_text('KIND = "stall"\n')
    found = spelled_protocol_strings(tmp_path, {"protocol.py"}, wire=("routes.py",))
    assert [line.split(": ", 1)[1] for line in found] == [
        "'attached' (session state)",
        "'/v1/sessions/' (API path)",
        "'anomaly' (event kind)",
        "'break' (command)",
    ]


def test_the_named_protocol_constants_are_its_values() -> None:
    kinds = {protocol.ANOMALY, protocol.STALL, protocol.PARKED, protocol.LISTENING}
    kinds |= {protocol.ATTACHED, protocol.DETACHED, protocol.RESUMED, protocol.FINISHED}
    kinds |= {protocol.CI_FAILURE, protocol.FALLBACK_KIND, protocol.COMMAND_KIND, protocol.WAITING}
    kinds |= {protocol.LOST_KIND, protocol.KILLED}  # the broker's own
    assert kinds == protocol.EVENT_KINDS
    assert {protocol.FINAL_STATE, protocol.FAILED, protocol.KILLED_STATE} == protocol.FINAL_STATES
    assert set(protocol.STATES) >= protocol.FINAL_STATES
    commands = {protocol.BREAK, protocol.RESUME, protocol.DUMP_STACKS, protocol.DUMP_FLIGHT}
    commands.add(protocol.DETACH)
    assert commands == set(protocol.COMMANDS)
    assert {protocol.KUBERNETES, protocol.DOCKER, protocol.DEFAULT_RUNTIME} <= set(
        protocol.RUNTIMES
    )


def test_the_agent_handles_every_command() -> None:
    from breakpod._link import commands as broker_commands

    assert set(broker_commands.HANDLERS) == set(protocol.COMMANDS)


def test_no_agent_class_is_over_400_lines() -> None:
    """A class of one job stays readable: a larger one is split by job (the monitor was)."""
    long = []
    for path in sorted(AGENT_SRC.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                size = node.end_lineno - node.lineno + 1
                if size > 400:
                    long.append(f"{path.relative_to(AGENT_SRC)}: {node.name} ({size} lines)")
    assert long == []
