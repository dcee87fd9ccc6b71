"""Adapters that plug asyncvec's vector env into other RL libraries, one small module each.

Nothing here is imported until you ask for it, so asyncvec never needs these libraries:

* ``asyncvec.integrations.gymnasium``: ``make_vec`` (also ``asyncvec.make_vec``) and the
  ``gymnasium.make_vec("asyncvec/AsyncLLMVectorEnv-v0", ...)`` registration.
* ``asyncvec.integrations.sb3``: ``SB3VecEnv``, a Stable-Baselines3 ``VecEnv`` (extra ``sb3``).
* ``asyncvec.integrations.tianshou``: ``TianshouVectorEnv``, a Tianshou ``BaseVectorEnv`` with
  partial batches (``wait_num``, ``timeout``) (extra ``tianshou``).
* ``asyncvec.integrations.torchrl``: ``make_env``, a TorchRL ``GymWrapper`` (extra ``torchrl``).
* ``asyncvec.integrations.rllib``: ``register``, an RLlib env for
  ``gym_env_vectorize_mode="vector_entry_point"`` (extra ``rllib``).

What each keeps and drops (autoreset, partial batches, restarts) is in docs/integrations.md.
"""
