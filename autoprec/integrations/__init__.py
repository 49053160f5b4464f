"""Integrations with training frameworks; each imports its framework lazily
(``autoprec.integrations.hf`` needs transformers and accelerate)."""
