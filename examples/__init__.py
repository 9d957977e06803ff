"""Example programs trained by verl-async configs (docs/agents.md)."""
