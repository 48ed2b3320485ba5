"""Negative sampling: counter-based noise, exact samplers, top-k merge, live rows, the Sampler seam."""
