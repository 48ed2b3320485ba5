"""The paper's synthetic gradient-bias experiment (Zhang & Stratos 2021, section 5.5; authors' code
github.com/WenzhengZhang/hard-nce-el, gradient-bias/): one context, N labels, a population of
small entropy, an MLP trained on cross-entropy, and Theorem 1's bias of each negative scheme
measured by :func:`dist_nce.bias.estimator.estimate_bias` before and after every update.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from dist_nce.bias.estimator import KINDS, NegativeScheme, estimate_bias
from dist_nce.core.config import AT_LEAST_0, AT_LEAST_1, FRACTION, POSITIVE, Range, check_fields, to_dict


@dataclass
class SyntheticConfig:
    """Section 5.5 of the paper; defaults are the authors' (gradient-bias/main.py)."""

    num_labels: int = field(default=1000, metadata={"help": "size N of the label space",
                                                    "range": Range(ge=2, why="a gold and a negative")})
    temperature: float = field(default=1e-3, metadata={
        "help": "pop = softmax(u / temperature), u ~ U(0,1)^N; small values give a small-entropy population",
        "range": POSITIVE})
    hidden: int = field(default=300, metadata={"help": "width of the input vector and of the one ReLU layer",
                                               "range": AT_LEAST_1})
    updates: int = field(default=30, metadata={"help": "Adam updates on the cross-entropy loss", "range": AT_LEAST_0})
    batch_size: int = field(default=128, metadata={"help": "iid labels from pop per update", "range": AT_LEAST_1})
    lr: float = field(default=1e-3, metadata={"help": "Adam learning rate", "range": POSITIVE})
    num_negatives: int = field(default=4, metadata={"help": "K-1 negatives per gold (K=5 candidates)",
                                                    "range": AT_LEAST_1})
    num_draws: int = field(default=10, metadata={"help": "Monte Carlo draws of the negatives per measurement",
                                                 "range": Range(ge=2, why="the Monte Carlo error needs two")})
    schemes: list[str] = field(default_factory=lambda: ["hard", "random", "mixed"], metadata={
        "help": f"negative kinds to measure, from {list(KINDS)}"})
    hard_fraction: float = field(default=0.5, metadata={"help": "share of hard negatives in 'mixed'",
                                                        "range": FRACTION})
    adjusted: bool = field(default=False, metadata={"help": "measure losses.adjusted_nce_loss instead of losses.nce_loss"})
    seed: int = field(default=42, metadata={"help": "seeds the population, the model, the batches and the negatives",
                                            "range": AT_LEAST_0})

    def validate(self) -> None:
        for kind in self.schemes:
            if kind not in KINDS:
                raise ValueError(f"schemes: {kind!r} is not one of {list(KINDS)}")
        check_fields(self)  # the loader did already; direct constructions did not
        if self.num_negatives >= self.num_labels:
            raise ValueError(f"num_negatives: {self.num_negatives}: must be < num_labels ({self.num_labels})")

    def negative_schemes(self) -> list[NegativeScheme]:
        return [NegativeScheme(k, self.num_negatives, self.hard_fraction, self.adjusted) for k in self.schemes]


class UnconditionalMLP(nn.Module):
    """s_θ(y) for the one context of the synthetic task: a learned input vector e, one
    ReLU layer, and a linear map to N label scores (the authors' ``Model`` with dim > 0)."""

    def __init__(self, num_labels: int, hidden: int) -> None:
        super().__init__()
        self.input = nn.Parameter(torch.randn(hidden))
        self.layer = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, num_labels)

    def forward(self) -> Tensor:
        """Scores [1, N]."""
        return self.out(torch.relu(self.layer(self.input)))[None]


def make_population(num_labels: int, temperature: float, generator: torch.Generator) -> Tensor:
    """pop [N] = softmax(u / temperature), u ~ U(0,1)^N. Labels whose mass underflows
    fp32 get exactly 0 and drop out of the gold enumeration."""
    u = torch.rand(num_labels, generator=generator, dtype=torch.float64)
    return torch.softmax(u / temperature, 0).float()


def entropy(p: Tensor) -> float:
    """Shannon entropy in nats of the distribution ``p`` [N]."""
    nz = p[p > 0].double()
    return float(-(nz * nz.log()).sum())


def run_synthetic(cfg: SyntheticConfig, progress: bool = False) -> dict:
    """Train the MLP on cross-entropy and measure Theorem 1's bias before the first and
    after every update. Returns a JSON-ready dict: config, population entropy, and one
    record per measurement (``update`` 0 = initialisation)."""
    from tqdm.auto import tqdm

    gen = torch.Generator().manual_seed(cfg.seed)
    pop = make_population(cfg.num_labels, cfg.temperature, gen)
    with torch.random.fork_rng(devices=[]):  # model init from cfg.seed without touching the global RNG
        torch.manual_seed(cfg.seed)
        model = UnconditionalMLP(cfg.num_labels, cfg.hidden)
    opt = torch.optim.Adam(model.parameters(), lr=cfg.lr)
    schemes = cfg.negative_schemes()
    records = []
    train_loss = None
    for t in tqdm(range(cfg.updates + 1), desc="bias (synthetic)", disable=not progress):
        if t > 0:
            labels = torch.multinomial(pop, cfg.batch_size, replacement=True, generator=gen)
            loss = nn.functional.cross_entropy(model().expand(cfg.batch_size, -1), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            train_loss = float(loss.detach())
        report = estimate_bias(model(), model.parameters(), pop[None], schemes, cfg.num_draws,
                               seed=cfg.seed * 1_000_000_007 + t * 7_919)
        records.append({"update": t, "train_loss": train_loss, **report.to_json()})
    return {
        "config": to_dict(cfg),
        "population_entropy": entropy(pop),
        "population_support": int((pop > 0).sum()),
        "num_params": sum(p.numel() for p in model.parameters()),
        "records": records,
    }
