"""Zeshel (zero-shot entity linking) on top of the shared trainer: data, retriever evaluation, grid."""
