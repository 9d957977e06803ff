"""Reward scoring: rule sources in a scoring process of the generator's own, model sources
through reward-model clients, and the learner-side combination of the scores.

    rules.py      pure scoring of ``exact``, ``format``, ``math`` and ``function`` sources
    worker.py     the scoring process (ZMQ ROUTER; ``ScoreRules`` -> ``Scores``)
    scorer.py     the generator's entry point (``Scorer.score_group``), isolation and timeouts
    aggregate.py  normalisation, weighted combination and metrics (numpy, learner side)

See docs/rewards.md. Nothing is imported here so that the scoring process starts fast.
"""
