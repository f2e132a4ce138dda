pytest_plugins = ["tests.fixtures.redis", "tests.fixtures.sentinel", "tests.fixtures.proxy", "tests.fixtures.kube",
                  "tests.fixtures.kstatus", "tests.fixtures.node"]
