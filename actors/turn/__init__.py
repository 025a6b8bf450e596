"""The pure turn logic: the loop, the recovery and poison-turn policies, the watchdog rules,
compaction, loop detection, and the model and tool interfaces. No Ray, no Redis: the engine
drives it, and it is unit-tested alone (the import rule is checked by ``tests/test_layers.py``)."""
