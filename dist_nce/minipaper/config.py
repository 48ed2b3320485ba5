"""The mini-paper job's configuration (``configs/mini_paper/*.yaml``): which grids, on which seeds.

Three parts, each a grid of runs of an existing job with ``--set`` overrides on its base
config, so every cell is a run a user could start by hand:

* ``zeshel``: Table 1 in miniature (``jobs/zeshel_retriever.py``). Per architecture, one
  shared start (``warmup``: a random-negative run, Gillick et al.'s recipe that the paper
  cites for pretraining; omit it for a pretrained encoder), then every negative arm x seed
  branches from that one checkpoint (``model.init_from``) and trains the same steps
  (``branch``);
* ``reranker``: Table 2 in miniature (``jobs/zeshel_reranker.py``) over the candidates of
  the best non-random Zeshel retriever and of the random-negative one of its architecture,
  seed by seed;
* ``aida``: random vs hard vs mixed-p with a pretrained encoder (``jobs/aida_finetune.py``).

Overrides are ``key=value`` strings, exactly as the jobs' ``--set`` takes them.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from dist_nce.core.config import AT_LEAST_1, ConfigError, Range


def _help(text: str, bounds: Range | None = None, **kw):
    return field(metadata={"help": text, **({"range": bounds} if bounds else {})}, **kw)


Overrides = list[str]


def _check_overrides(where: str, sets: list[str]) -> None:
    for s in sets:
        if "=" not in s or not s.split("=", 1)[0].strip():
            raise ConfigError(f"{where}: {s!r} is not key=value")


def _check_named(where: str, named: dict[str, Overrides]) -> None:
    for name, sets in named.items():
        if not re.fullmatch(r"[A-Za-z0-9_]+", name):  # part of cell, directory and Ray Train run names
            raise ConfigError(f"{where}.{name}: a name of letters, digits and '_' only")
        _check_overrides(f"{where}.{name}", sets)


def _check_grid(sets: Overrides, architectures: dict[str, Overrides], arms: dict[str, Overrides]) -> None:
    """A part's common overrides, its named architectures and arms, and the 'random' arm every
    verdict compares against."""
    _check_overrides("set", sets)
    _check_named("architectures", architectures)
    _check_named("arms", arms)
    if architectures and "random" not in arms:
        raise ValueError(f"arms: needs a 'random' arm to compare against, got {sorted(arms)}")


@dataclass
class ZeshelPart:
    config: str = _help("Base retriever YAML (jobs/zeshel_retriever.py).",
                        default="configs/zeshel/retriever_tiny_cpu.yaml")
    set: Overrides = _help("Overrides for every cell of this part.", default_factory=list)
    seeds: Optional[list[int]] = _help("Seeds of this part's cells; null = the top-level seeds.", Range(ge=0),
                                       default=None)
    warmup: Optional[Overrides] = _help(
        "Overrides of the shared start of each architecture (run once, seed warmup_seed); every arm x seed "
        "starts from its exported model. null = every cell starts from the base config's model.", default=None)
    warmup_seed: int = _help("Seed of the shared start (its own, apart from the arms' seeds).",
                             Range(ge=0), default=1000)
    branch: Overrides = _help("Overrides of every arm x seed cell (the steps after the shared start).",
                              default_factory=list)
    architectures: dict[str, Overrides] = _help("Architecture name -> overrides (model.retriever.*, backend).",
                                                default_factory=dict)
    arms: dict[str, Overrides] = _help("Negative arm name -> overrides (negatives.*); one must be 'random'.",
                                       default_factory=dict)

    def validate(self) -> None:
        _check_grid(self.set, self.architectures, self.arms)
        _check_overrides("warmup", self.warmup or [])
        _check_overrides("branch", self.branch)


@dataclass
class RerankerPart:
    config: str = _help("Base reranker YAML (jobs/zeshel_reranker.py).",
                        default="configs/zeshel/reranker_tiny_cpu.yaml")
    set: Overrides = _help("Overrides for every reranker cell.", default_factory=list)
    seeds: Optional[list[int]] = _help("Seeds of Table 2 (each reranks the retriever run of the same seed, so a "
                                       "subset of the zeshel part's); null = the zeshel part's.", Range(ge=0),
                                       default=None)
    enabled: bool = _help("Run Table 2 (needs the zeshel part).", default=True)


@dataclass
class AidaPart:
    config: str = _help("Base AIDA YAML (jobs/aida_finetune.py).", default="configs/aida/tiny_cpu.yaml")
    set: Overrides = _help("Overrides for every AIDA cell.", default_factory=list)
    seeds: Optional[list[int]] = _help("Seeds of this part's cells; null = the top-level seeds.", Range(ge=0),
                                       default=None)
    architectures: dict[str, Overrides] = _help("Architecture name -> overrides.", default_factory=dict)
    arms: dict[str, Overrides] = _help("Negative arm name -> overrides; one must be 'random'.",
                                       default_factory=dict)

    def validate(self) -> None:
        _check_grid(self.set, self.architectures, self.arms)


@dataclass
class MiniPaperConfig:
    seeds: list[int] = _help("Seeds of every arm (at least 3 for a verdict).", Range(ge=0),
                             default_factory=lambda: [0, 1, 2])
    parallel: int = _help("Cells run at once (each is a job process on the shared local Ray).", AT_LEAST_1,
                          default=1)
    zeshel: ZeshelPart = _help("Table 1 in miniature.", default_factory=ZeshelPart)
    reranker: RerankerPart = _help("Table 2 in miniature.", default_factory=RerankerPart)
    aida: AidaPart = _help("AIDA with a pretrained encoder.", default_factory=AidaPart)

    def validate(self) -> None:
        for where, seeds in (("seeds", self.seeds), ("zeshel.seeds", self.zeshel.seeds),
                             ("reranker.seeds", self.reranker.seeds), ("aida.seeds", self.aida.seeds)):
            if seeds is not None and (not seeds or len(set(seeds)) != len(seeds)):
                raise ValueError(f"{where}: need distinct seeds, got {seeds}")
        missing = sorted(set(self.seeds_of("reranker")) - set(self.seeds_of("zeshel")))
        if self.reranker.enabled and missing:
            raise ValueError(f"reranker.seeds: {missing} have no zeshel retriever run to rerank "
                             f"(zeshel seeds {self.seeds_of('zeshel')})")
        if self.reranker.enabled and not self.zeshel.architectures:
            raise ValueError("reranker.enabled: Table 2 reranks the zeshel part's candidates; "
                             "zeshel.architectures is empty")

    def seeds_of(self, part: str) -> list[int]:
        """A part's seeds: its own, else (Table 2) the zeshel part's, else the top-level ones."""
        own = getattr(self, part).seeds
        if own is not None:
            return own
        return self.seeds_of("zeshel") if part == "reranker" else self.seeds
