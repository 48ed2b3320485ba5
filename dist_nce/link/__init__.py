"""Link new text with a trained run: Python API (Linker), jobs/link.py, Ray Serve (serve.py)."""
from dist_nce.link.linker import Linker

__all__ = ["Linker"]
