"""splitserve.cluster: configuration, starting the pools, and the command line."""
