pytest_plugins = ["tests.fixtures.redis", "tests.fixtures.redis_cluster", "tests.fixtures.sentinel",
                  "tests.fixtures.proxy", "tests.fixtures.kube", "tests.fixtures.kstatus", "tests.fixtures.node"]


def pytest_configure(config):
    # tooling/test.sh runs the Redis-facing tests again against Redis 6.2 without these
    config.addinivalue_line("markers", "redis7: about what only Redis 7 has (functions); not run against 6.2")
