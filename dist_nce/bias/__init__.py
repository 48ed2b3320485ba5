"""Theorem 1: the gradient-bias estimator, its per-batch form, the live monitor, the synthetic experiment."""
