"""The agent of the tool-scaling figure: the scripted model, whose one tool only waits.

``sleep`` waits for the scenario's ``tool_latency_ms`` and runs at most 4 calls at once per
ToolWorker, so a pool's throughput is bounded by its size, not by this machine's two cores: a
latency-bound tool (an API call, a database query) is what more workers help with. A
CPU-bound tool could not scale past the cores here.
"""

from __future__ import annotations

import dataclasses

from actors.engine.models import scripted
from actors.engine.tools.builtin_tools import sleep
from actors.turn.tools import ToolRegistry

#: Calls of ``sleep`` one worker runs at once.
PER_WORKER = 4

agent = dataclasses.replace(
    scripted.agent, tools=ToolRegistry([dataclasses.replace(sleep, max_concurrency=PER_WORKER)])
)
