"""Durable state. At the top, what every part shares: record schemas (``records``), their codec,
the key layout (``keys``) and the Lua scripts (``lua/``). Then one sub-package per role:
``redis`` (talking to Redis), ``write`` (a turn's fenced save), ``domain`` (the durable facts
beside a record, one store each) and ``views`` (what readers read instead of the turns)."""
