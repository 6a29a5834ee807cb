"""The data loaders (loaders/): formats, replicas, caching, order and resume."""
