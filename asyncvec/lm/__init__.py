"""Language-model policies acting and learning (the ``asyncvec/lm/`` room).

* :mod:`asyncvec.lm.learner`: ``LMBatch`` (one-step completions as learner tensors),
  ``EpisodeBatch`` (multi-turn episodes, model tokens only), teacher-forced log-probs, the
  supervised warm start;
* :mod:`asyncvec.lm.chat`: ``Conversation``, the prefix-stable rendering of a multi-turn
  episode (chat template, or the plain format);
* :mod:`asyncvec.lm.episodes`: ``EpisodeCollector``, episodes of a text policy in an
  ``AsyncLLMVectorEnv``, k per reset seed; their records (``Turn``, ``Episode``,
  ``EpisodeGroups``) in :mod:`asyncvec.lm.episode_records`;
* :mod:`asyncvec.lm.text_env`: ``TextEnv`` (any Discrete-action env as a text env),
  ``StringEnv`` (a plain ``reset()/step(str)`` object with Text spaces);
* :mod:`asyncvec.lm.groups`: ``GroupCollector`` (k scored completions per prompt);
* :mod:`asyncvec.lm.rewards`: reward plugins and the ``RewardService``, a package
  (``registry``, ``parsers``, ``models``, ``service``);
* what the LM agents (``agents/rloo.py``, ``agents/reinforce_pp.py``, ``agents/grpo.py``) build
  and call: :mod:`asyncvec.lm.options` (``LMArgs``), :mod:`asyncvec.lm.backends` (``LM_BACKENDS``,
  the table of backends), :mod:`asyncvec.lm.build` (``build_parts``, ``is_multi_turn``),
  :mod:`asyncvec.lm.staleness` (``Staleness``: ``--max-staleness`` and its three uses),
  :mod:`asyncvec.lm.prompts`, :mod:`asyncvec.lm.training` (``LMAgent``, the agents' base:
  ``train``, checkpoints, publishing; ``trainable_batch``, ``LearnerStep``, ``TrainingRun``),
  :mod:`asyncvec.lm.evaluation`, :mod:`asyncvec.lm.results` (``LMTrainResult``, ``summary``).

Names are imported lazily (an env worker importing ``asyncvec.lm.text_env`` never pays for
torch).

Example:
    >>> from asyncvec.lm import Conversation, LMBatch
    >>> LMBatch.__module__
    'asyncvec.lm.learner'
"""

from __future__ import annotations

from asyncvec.lazy import lazy_package

# public name -> module that defines it
_LAZY = {
    "LMBatch": "asyncvec.lm.learner",
    "EpisodeBatch": "asyncvec.lm.learner",
    "completion_logps": "asyncvec.lm.learner",
    "sequence_logps": "asyncvec.lm.learner",
    "load_causal_lm": "asyncvec.lm.learner",
    "minibatch_updates": "asyncvec.lm.learner",
    "quiet_model_libraries": "asyncvec.lm.learner",
    "sft_warm_start": "asyncvec.lm.learner",
    "Conversation": "asyncvec.lm.chat",
    "PlainChatFormat": "asyncvec.lm.chat",
    "Turn": "asyncvec.lm.episode_records",
    "Episode": "asyncvec.lm.episode_records",
    "EpisodeGroups": "asyncvec.lm.episode_records",
    "EpisodeCollector": "asyncvec.lm.episodes",
    "make_text_vector_env": "asyncvec.lm.episodes",
    "TextEnv": "asyncvec.lm.text_env",
    "StringEnv": "asyncvec.lm.text_env",
    "check_text_env": "asyncvec.lm.text_env",
    "text_space": "asyncvec.lm.text_env",
    "GroupCollector": "asyncvec.lm.groups",
    "ScoredCompletion": "asyncvec.lm.groups",
    "score_completions": "asyncvec.lm.groups",
    "RewardService": "asyncvec.lm.rewards",
}

__all__ = sorted(_LAZY)

# every other name is looked up where the old asyncvec/lm.py module's names went
__getattr__ = lazy_package(globals(), _LAZY, also_from="asyncvec.lm.learner")[0]


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
