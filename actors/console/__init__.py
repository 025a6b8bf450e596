"""The web console (``phaseline ui``): server-rendered pages over the same records and events
the CLI reads, live through server-sent events, with the operator's actions.

A layer of its own above ``actors.cluster`` (it attaches to a running deployment for the
deployment page and to tell a host of a cancel) and below the CLI. It keeps no state of its
own: every page is read from Redis when asked.
"""

from actors.console.app import ConsoleSettings, console_app

__all__ = ["ConsoleSettings", "console_app"]
