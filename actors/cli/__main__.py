"""``python -m actors.cli``: the ``phaseline`` command."""

from actors.cli import main

main()
