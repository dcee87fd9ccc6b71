"""Checks that tests and users run against a backend: log-probs against teacher-forced transformers, weight sync.

Example: ``python -m asyncvec.testing.checks vllm-policy --work DIR`` (see `asyncvec.testing.checks`).
"""
