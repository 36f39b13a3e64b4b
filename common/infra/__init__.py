"""Local start-up of the substrate's servers: nats-server (JetStream) and redis-server.

    with NatsServer() as nats, RedisServer() as redis:
        ...  # nats.url, redis.url

Used by the test fixtures and by `trident up` where there is no Docker engine.
"""

from common.infra.nats_server import DEFAULT_MAX_PAYLOAD, NatsServer, nats_server_binary
from common.infra.process import InfraError, LocalServer, free_port
from common.infra.redis_server import RedisServer, redis_server_binary

__all__ = [
    "DEFAULT_MAX_PAYLOAD",
    "InfraError",
    "LocalServer",
    "NatsServer",
    "RedisServer",
    "free_port",
    "nats_server_binary",
    "redis_server_binary",
]
