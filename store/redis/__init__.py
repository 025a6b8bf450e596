"""Talking to Redis: connections and the one transport every write goes through, the lean
connection, cluster nodes and their redirects, URLs, errors translated at the boundary,
durability waits, batching, and the embedded servers (one, or a local cluster)."""
