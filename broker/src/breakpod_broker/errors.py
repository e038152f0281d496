"""Errors raised by the broker.

    BrokerError
    ├── ConfigError        a setting, token file or argument the broker cannot use
    └── RedisServerError   the embedded redis-server could not be found or started

HTTP errors are FastAPI ``HTTPException``s raised at the route boundary;
these classes are for the process around the app (settings, CLI, Redis).

Each name means one thing across both distributions: ``ConfigError`` is a value
its process cannot use in the agent too; a request to this broker that failed is
the agent's ``BrokerRequestError``, never a ``BrokerError``.
"""

from __future__ import annotations


class BrokerError(Exception):
    """Base class of every error the broker raises."""


class ConfigError(BrokerError, ValueError):
    """A setting, token file or argument has a value the broker cannot use."""


class RedisServerError(BrokerError, OSError):
    """The embedded redis-server could not be found or started."""
