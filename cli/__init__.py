"""splitserve.cli: the ``splitserve`` command (serve, generate, status, bench, plan,
profile). It sits above every other package: it imports the cluster and the
benchmarks, and nothing imports it."""
