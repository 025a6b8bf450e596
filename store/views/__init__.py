"""Read models: what the CLI, the console and waiting callers read instead of the turns
themselves (summaries, the bus and live streams, watching a turn, final records, per-shard
sums, the archive of a finished turn)."""
