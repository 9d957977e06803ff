"""Off-policy correction (``algo.correction``), in three modules:

  settings    the grammar, presets and resolution of verl's rollout-correction settings
              (``algo.rollout_correction``). No torch: the config schema imports it, so
              neither this package nor ``verl_async.algos`` imports torch on import.
  off_policy  ``off_policy_correction``: what a policy loss's ratio is taken against
              (pi_prox or pi_behav) and the per-token weights and mask it is multiplied
              by, for each of none, tis, decoupled and rollout.
  rollout     verl's rollout correction tensors: importance weights, rejection sampling
              and the ``rollout_corr/*`` metrics, from two log-probs per token.

The learner's whole-step part (weights and rejection over every row of a step, before the
first minibatch) is ``learners/whole_step_correction.py``.
"""
