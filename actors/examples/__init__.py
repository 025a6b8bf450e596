"""Example agents to copy: ``actors.examples.assistant:agent``."""
