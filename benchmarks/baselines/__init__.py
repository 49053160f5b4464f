"""Baseline searches for ``benchmarks/tune_baselines.py`` (issue 6): uniform precisions,
greedy per-layer fallback (probe-ranked, and Neural Compressor's ``basic``), segment
bisection (onnxconverter-common), random search and the exhaustive optimum, all scored by
autoprec's own evaluator, cost model and selection rule."""
