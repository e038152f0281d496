from tests.brokerkit import _shared_broker, broker, redis_server, redis_url  # noqa: F401
