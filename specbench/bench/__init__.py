"""A run: its configuration, the orchestrator, and a serving engine's part."""
