"""breakpod broker: sessions, events, commands and attach instructions over Redis.

breakpod-broker serve                   # embedded Redis, tokens from the environment
breakpod_broker.app.create_app(settings) # the ASGI app, for uvicorn or tests
"""

__version__ = "0.1.0"
