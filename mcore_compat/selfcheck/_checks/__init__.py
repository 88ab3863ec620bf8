"""The checks of :class:`~mcore_compat.selfcheck.verify.StepVerifier`, one module per report name.

Each module named after a check (``grads_match_reference``, ``grad_norm_matches_reference``,
``update_matches_optimizer_rule``, ``model_params_match_main``, ``all_params_changed``,
``state_unchanged_between_steps``, ``replicas_identical``, ``optimizer_covers_params``) holds that check's logic
and its verdict as a mixin of the verifier; :mod:`.base` the state they share (the snapshot, the fingerprints),
:mod:`.tally` one check's findings over the steps, :mod:`.values` the tensor helpers. The order of a step (what
runs when) stays in :mod:`mcore_compat.selfcheck.verify`.
"""
