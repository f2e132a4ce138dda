pytest_plugins = ["tests.fixtures.redis", "tests.fixtures.proxy", "tests.fixtures.kube", "tests.fixtures.kstatus"]
