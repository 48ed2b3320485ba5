"""Negative-sampling modes, one file each: importing this package imports every module in it,
and each registers its class (``samplers.register``). A new mode is a file here plus its literal
in ``NegativesConfig.mode`` (``dist_nce/train/config.py``); nothing else names the modes."""
from __future__ import annotations

import importlib
import pkgutil

from dist_nce.sampling.samplers import MODES, Sampler

for _info in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_info.name}")


def modes() -> list[str]:
    """The registered mode names, sorted."""
    return sorted(MODES)


def sampler_for(mode: str, num_negatives: int, p: float = 50.0) -> Sampler:
    """The sampler of ``mode`` for K-1 = ``num_negatives`` (``p``: mixed-p's percentage)."""
    if mode not in MODES:
        raise ValueError(f"negatives.mode: expected one of {modes()}, got {mode!r}")
    if num_negatives < 1:
        raise ValueError(f"K-1 = {num_negatives}: need at least one negative")
    return MODES[mode](num_negatives, p)


def sampler_for_split(n_hard: int, n_random: int, p_mixed: float | None = None) -> Sampler:
    """The sampler that draws ``n_hard`` hard and ``n_random`` uniform negatives: random when
    n_hard is 0, hard when n_random is 0, mixed otherwise (``NegativeService.mine``'s form)."""
    total = n_hard + n_random
    if n_hard == 0:
        return sampler_for("random", total)
    if n_random == 0:
        return sampler_for("hard", total)
    return sampler_for("mixed", total, 100 * n_hard / total if p_mixed is None else p_mixed)
