"""Link new text with a trained run: Python API (Linker), the link job (dist_nce.cli.link), Ray Serve (serve.py)."""
from dist_nce.link.linker import Linker

__all__ = ["Linker"]
