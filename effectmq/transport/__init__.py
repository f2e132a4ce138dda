"""Transport, the bottom layer: Redis clients and URLs (plain, Sentinel, Cluster), the
redis-py internals reached into, credentials kept out of messages, and Redis server time.
Knows nothing of queues; everything above talks to Redis through it."""
