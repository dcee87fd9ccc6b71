"""Benchmarks: each script compares side by side in one run; see docs/benchmarks.md.

A regular package, so that torchrl 0.14's stray top-level ``benchmarks`` package in site-packages
cannot shadow this one.
"""
