"""Benchmarks: scripts that print the tables the README and benchmarks/results/ quote.

Run each from the repository root as a module (``python -m benchmarks.deploy_form
--help``); ``benchmarks.common`` is their one way to find and load the examples.
``benchmarks.registry`` is the suite (``python -m benchmarks list``);
tests/benchmarks/test_smoke.py runs each at its toy size.
"""
