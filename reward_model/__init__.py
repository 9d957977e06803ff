"""The reward-model role: ``python -m reward_model --run-dir DIR --name SOURCE`` serves one
``model`` reward source (see ``server.py`` and docs/reward_models.md)."""
