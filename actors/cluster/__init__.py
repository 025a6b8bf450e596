"""The Ray side: one module per actor (TurnActor, CheckpointActor, WatchdogActor, RecoveryActor,
Supervisor, ToolWorker), the deployment that wires them by name, and the Runtime facade."""
