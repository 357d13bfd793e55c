"""Data-plane glue that runs inside the pods: contract (names, labels, NIXL identity), router, preflight, KV transfer."""
