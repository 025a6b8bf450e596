"""``phaseline bench``: what durability costs, each figure beside a baseline from the same run.

One module per figure family: :mod:`~actors.bench.sizes` (bytes per checkpoint),
:mod:`~actors.bench.probe` (checkpoint latency and throughput, from a host-like process),
:mod:`~actors.bench.workload` (durability overhead, turns/s per host count, turns per host),
:mod:`~actors.bench.recovery` (host SIGKILL against Ray's own actor restart), tied together
by :mod:`~actors.bench.runner` into the JSON report with its ``targets`` list.
"""
