pytest_plugins = ["tests.fixtures.redis", "tests.fixtures.redis_cluster", "tests.fixtures.sentinel",
                  "tests.fixtures.proxy", "tests.fixtures.kube", "tests.fixtures.kstatus", "tests.fixtures.node"]
