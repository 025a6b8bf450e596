"""Running turns in one process against Redis: the turn engine (also the core of every Ray
TurnActor), the tool batch executor with the ledger rules, resume plans, settings, the scripted
model, scenarios and the built-in tools. No Ray."""
