"""Metrics, KILT prediction files and scores, Zeshel evaluation."""
