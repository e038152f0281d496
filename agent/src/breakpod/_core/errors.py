"""Errors raised by breakpod (the broker's own, ``breakpod_broker.errors``, name other
things: each name means one thing across both distributions).

    BreakpodError
    ├── ConfigError            a setting or argument has a value breakpod cannot use
    │   ├── InsecureBindError  a non-loopback bind without the required opt-in
    │   └── RuleError          a monitor rule is invalid (names the rule and the field)
    ├── ListenerError          a listener could not be started or reached
    │   └── AttachError        the CLI could not attach to a listener
    ├── BrokerRequestError     a request to the broker failed: unreachable, or refused
    └── AnomalyError           a monitor rule with ``action: stop`` fired

Inside the training process breakpod never lets these escape from a
``breakpoint()`` or a hook; they reach callers only from explicit API calls
(``init_remote_debugger(...)``, ``watch(...)``) and from the CLI; the one
deliberate exception is :class:`AnomalyError`, raised into the training
loop by a rule whose action is ``stop``.
"""

from __future__ import annotations


class BreakpodError(Exception):
    """Base class of every error breakpod raises."""


class ConfigError(BreakpodError, ValueError):
    """A setting or argument has a value breakpod cannot use."""


class InsecureBindError(ConfigError):
    """A listener was asked to bind a non-loopback address without the opt-in."""


class ListenerError(BreakpodError, OSError):
    """A listener could not be started."""


class AttachError(ListenerError):
    """The CLI could not attach to a listener."""


class BrokerRequestError(BreakpodError):
    """The broker could not be reached, or refused a request (``status`` says how)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class RuleError(ConfigError):
    """A monitor rule is invalid; the message names the rule and the field."""


class AnomalyError(BreakpodError, RuntimeError):
    """A monitor rule with ``action: stop`` fired; ``.anomaly`` says what and where."""

    def __init__(self, anomaly: object) -> None:
        super().__init__(f"breakpod stopped training: {anomaly}")
        self.anomaly = anomaly
