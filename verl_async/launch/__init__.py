"""What starts and watches a run: the ``verl-async`` command, the local and Ray launchers,
the role commands, the run directory, progress, plots, export and model builders.

The roles (``generators/``, ``learners/``, ``buffer/``, ``reward_model/``) never import this
package; it imports them only as command lines (``python -m <role>``).
"""
