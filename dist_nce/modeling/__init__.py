"""Score functions, encoders, the retriever, the reranker and BLINK import."""
