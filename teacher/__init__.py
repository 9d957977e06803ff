"""The teacher role: ``python -m teacher --run-dir DIR --name TEACHER`` serves one
distillation teacher's log-probs of the generators' sampled tokens (``server.py``,
docs/distillation.md)."""
