"""Running turns in one process against Redis: the turn engine (also the core of every Ray
TurnActor) and what it needs at the top (the turns it runs, their checkpoints, resume plans, the
front desk, submission, agents); model clients in ``models``, tool running in ``tools``,
settings in ``settings``. No Ray."""
