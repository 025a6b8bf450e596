"""Settings: the config model and its TOML files, what an engine is made with, the shipped
configs, optional extras."""
