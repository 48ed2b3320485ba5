"""Training and evaluating the joint cross-encoder reranker over fixed candidate sets."""
