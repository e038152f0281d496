from tests.brokerkit import _shared_broker, broker, redis_server, redis_url, start_broker  # noqa: F401
