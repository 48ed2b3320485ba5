"""dist-nce: distributed hard-negative NCE for entity-linking retrievers.

Zhang & Stratos, "Understanding Hard Negatives in Noise Contrastive Estimation", NAACL 2021.
"""
__version__ = "0.1.0"
