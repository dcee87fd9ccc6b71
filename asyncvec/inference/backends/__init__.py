"""Inference backends, one module each: a local torch module, a transformers model, an in-process vLLM engine, an
OpenAI-compatible server over HTTP, the tiny VLA (and its vLLM variant), and a latency stand-in.

Each subclasses `asyncvec.inference.BatchedPolicy`; import them from `asyncvec.inference`, which loads a backend (and
torch, transformers, httpx or vllm) only when its name is first used.
"""
