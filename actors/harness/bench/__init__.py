"""``phaseline bench``: what durability costs, each figure beside a baseline from the same run.

One module per figure family: :mod:`~actors.harness.bench.sizes` (bytes per checkpoint),
:mod:`~actors.harness.bench.probe` (checkpoint latency and throughput, from a host-like process),
:mod:`~actors.harness.bench.workload` (durability overhead, turns/s per host count, turns per host),
:mod:`~actors.harness.bench.recovery` (host SIGKILL against Ray's own actor restart), tied together
by :mod:`~actors.harness.bench.runner` into the JSON report with its ``targets`` list.
"""
