"""Behaviour: the turn loop, LLM and tool adapters, the engines that drive them, the CLI."""
