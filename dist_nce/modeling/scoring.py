"""The general score function of Zhang & Stratos (2021, section 4) and its presets.

Encoders give token states ``E(x)`` [T, d] for a mention and ``F(y)`` [T', d] for an
entity (position 0 is ``[CLS]``). One side supplies the *queries* Q and the other the
*keys* K (``direction`` "x->y": Q = E(x), K = F(y); "y->x": the reverse). Each side is
reduced to a few vectors: its leftmost ``count`` columns, ``count`` learned codes
attending over its tokens (``c_j = sum_t softmax_t(code_j . h_t) h_t`` over real
tokens t), or all of its real columns. The score is

    s(x, y) = sum_{t <= m} q_t . (K_m' Attn(K_m'^T Q_m))_t
            = sum_{t <= m} sum_{j <= m'} Attn(K_m'^T Q_m)_{jt} (k_j . q_t)

with ``Attn`` normalising each column over the keys: Soft = softmax, Hard = one-hot of
the argmax (so a Hard column contributes ``max_j k_j . q_t``). The paper writes this
as ``1_m^T Q_m^T K_m' Attn(K_m'^T Q_m)``; read literally that is a 1 x m row, and the
scalar the presets need is its trace (the sum of the diagonal), as above.

Presets (``ScoreSpec.preset``):

=========  =====================================  =====================================
dual       E_1(x) . F_1(y)                         one vector per side
poly-m     F_1(y)^T C_m(x, y)                      y->x, Q = F_1(y), K = m codes over E(x), soft
multi-m    max_{t<=m} E_1(x) . F_t(y)              x->y, Q = E_1(x), K = leftmost m of F(y), hard
som        sum_t max_t' E_t(x) . F_t'(y)           x->y, all real columns of both, hard
genpoly-m  sum_{t<=m} F_t(y)^T C_m(x, y)_t         y->x, Q = leftmost m of F(y), K = m codes, soft
=========  =====================================  =====================================

Padding never takes part in a score: a padded query column contributes 0 and a padded
key is never attended to or maxed over. (The authors' code, github.com/WenzhengZhang/
hard-nce-el, maxes over padded entity tokens and sums padded mention tokens in its SOM
and multi-vector scores, and attends entity codes with the wrong mask; dist-nce does not.)

Dtypes: pairwise similarities are computed in the inputs' dtype (bf16 GEMMs are ~3x
faster on CPU); softmax and every sum over query columns accumulate in at least fp32,
so half-precision inputs give fp32 scores.

References: W. Zhang and K. Stratos, "Understanding Hard Negatives in Noise Contrastive
Estimation", NAACL 2021 (arXiv:2104.06245), section 4; S. Humeau et al.,
"Poly-encoders", ICLR 2020.
"""
from __future__ import annotations

import dataclasses
from typing import Literal, NamedTuple

import torch
from torch import Tensor

Direction = Literal["x->y", "y->x"]
Reduction = Literal["first", "codes", "all"]
Attention = Literal["soft", "hard"]

PRESETS = ("dual", "poly", "multi", "som", "genpoly")

# Default cap on the similarity block one chunk of ``score_all`` materialises
# (2^23 elements = 32 MiB in fp32): large enough to keep GEMMs efficient, small
# enough that SOM over thousands of 128-token entities stays in cache-friendly pieces.
_SIM_BUDGET = 1 << 23


class Reps(NamedTuple):
    """What one side of the score keeps per example.

    ``vecs``: [..., d] (one vector) or [..., n, d] (n vectors). ``mask``: [..., n] bool,
    True = real position, for multi-vector reps that may contain padding; else None.
    """

    vecs: Tensor
    mask: Tensor | None = None


class MipsVectors(NamedTuple):
    """Entity vectors for maximum-inner-product search: ``vecs`` [M, d] and ``owners``
    [M] int64 (row of the entity each vector belongs to). s(x, y) is the maximum of
    ``u(x) . vecs[i]`` over the vectors i owned by y."""

    vecs: Tensor
    owners: Tensor


class Side(NamedTuple):
    reduction: Reduction
    count: int | None


@dataclasses.dataclass(frozen=True)
class ScoreSpec:
    """One instance of the general score function (the design choices of section 4)."""

    direction: Direction = dataclasses.field(
        default="x->y", metadata={"help": "x->y: mention columns are queries; y->x: entity columns are queries"}
    )
    query_reduction: Reduction = dataclasses.field(
        default="first", metadata={"help": "first: leftmost columns; codes: learned codes; all: every real column"}
    )
    query_count: int | None = dataclasses.field(
        default=1, metadata={"help": "m, the number of query vectors (None for 'all')"}
    )
    key_reduction: Reduction = dataclasses.field(
        default="first", metadata={"help": "first: leftmost columns; codes: learned codes; all: every real column"}
    )
    key_count: int | None = dataclasses.field(
        default=1, metadata={"help": "m', the number of key vectors (None for 'all')"}
    )
    attention: Attention = dataclasses.field(
        default="hard", metadata={"help": "soft: softmax over keys; hard: max over keys"}
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        if self.direction not in ("x->y", "y->x"):
            raise ValueError(f"direction must be 'x->y' or 'y->x', got {self.direction!r}")
        if self.attention not in ("soft", "hard"):
            raise ValueError(f"attention must be 'soft' or 'hard', got {self.attention!r}")
        for role, red, count in (("query", self.query_reduction, self.query_count),
                                 ("key", self.key_reduction, self.key_count)):
            if red == "all":
                if count is not None:
                    raise ValueError(f"{role}_count must be None when {role}_reduction is 'all', got {count}")
            elif red in ("first", "codes"):
                if isinstance(count, bool) or not isinstance(count, int) or count < 1:
                    raise ValueError(f"{role}_count must be a positive integer for '{red}', got {count!r}")
            else:
                raise ValueError(f"{role}_reduction must be 'first', 'codes' or 'all', got {red!r}")

    @classmethod
    def preset(cls, name: str, m: int | None = None) -> ScoreSpec:
        """The paper's architectures: "dual", "som" (no m), "poly", "multi", "genpoly" (need m)."""
        if name not in PRESETS:
            raise ValueError(f"unknown score preset {name!r}; expected one of {list(PRESETS)}")
        if name in ("dual", "som"):
            if m is not None:
                raise ValueError(f"score preset {name!r} takes no m (got m={m})")
        elif m is None:
            raise ValueError(f"score preset {name!r} needs m, the number of vectors")
        if name == "dual":
            return cls("x->y", "first", 1, "first", 1, "hard")
        if name == "som":
            return cls("x->y", "all", None, "all", None, "hard")
        if name == "multi":
            return cls("x->y", "first", 1, "first", m, "hard")
        if name == "poly":
            return cls("y->x", "first", 1, "codes", m, "soft")
        return cls("y->x", "first", m, "codes", m, "soft")  # genpoly

    @property
    def mention_side(self) -> Side:
        """How E(x) is reduced."""
        if self.direction == "x->y":
            return Side(self.query_reduction, self.query_count)
        return Side(self.key_reduction, self.key_count)

    @property
    def entity_side(self) -> Side:
        """How F(y) is reduced."""
        if self.direction == "x->y":
            return Side(self.key_reduction, self.key_count)
        return Side(self.query_reduction, self.query_count)

    def __str__(self) -> str:
        def side(red: str, n: int | None) -> str:
            return red if n is None else f"{red}:{n}"

        return (f"ScoreSpec({self.direction}, Q={side(self.query_reduction, self.query_count)}, "
                f"K={side(self.key_reduction, self.key_count)}, {self.attention})")


# --------------------------------------------------------------------------- reps


def _reduce_tokens(side: Side, states: Tensor, mask: Tensor | None, codes: Tensor | None, what: str,
                   checked: bool = False) -> Reps:
    """states [P, T, d], mask [P, T] -> Reps [P, d] (count 1) or [P, n, d] (+ mask).

    ``checked``: the caller checked on the host that every row's first token is real
    (:func:`dist_nce.modeling.retriever.host_checked`), so the mask is not read here (reading a
    device tensor's value waits for the device)."""
    if states.ndim != 3:
        raise ValueError(f"{what}: token states must be [batch, T, d], got shape {tuple(states.shape)}")
    p, t, d = states.shape
    if mask is None:
        mask = torch.ones(p, t, dtype=torch.bool, device=states.device)
    elif mask.shape != (p, t):
        raise ValueError(f"{what}: mask must be [{p}, {t}] like the states, got {tuple(mask.shape)}")
    mask = mask.bool()
    if t == 0 or not (checked or bool(mask.any(-1).all())):
        raise ValueError(f"{what}: every row needs at least one real token (mask all False in some row)")

    if side.reduction == "codes":
        if codes is None:
            raise ValueError(f"{what}: the score spec reduces this side with {side.count} codes; pass codes [m, d]")
        if codes.shape != (side.count, d):
            raise ValueError(f"{what}: codes must be [{side.count}, {d}], got {tuple(codes.shape)}")
        logits = torch.einsum("md,ptd->pmt", codes.to(states.dtype), states)
        acc = torch.promote_types(states.dtype, torch.float32)
        weights = torch.softmax(logits.masked_fill(~mask[:, None, :], float("-inf")), dim=-1, dtype=acc)
        out = weights.to(states.dtype) @ states  # [P, m, d]
        return Reps(out[:, 0] if side.count == 1 else out, None)
    if codes is not None:
        raise ValueError(f"{what}: codes given but the score spec reduces this side with '{side.reduction}'")
    if side.reduction == "all":
        return Reps(states, mask)
    m = side.count
    if m == 1:
        if not (checked or bool(mask[:, 0].all())):
            raise ValueError(f"{what}: position 0 ([CLS]) is padding in some row; leftmost-1 reduction needs it")
        return Reps(states[:, 0], None)
    if t < m:  # the encoder trimmed padding below m: pad back with masked zeros
        states = torch.cat([states, states.new_zeros(p, m - t, d)], dim=1)
        mask = torch.cat([mask, mask.new_zeros(p, m - t)], dim=1)
    return Reps(states[:, :m], mask[:, :m])


def mention_reps(spec: ScoreSpec, E: Tensor, mask: Tensor | None, codes: Tensor | None = None,
                 checked: bool = False) -> Reps:
    """Mention encoder output E [B, T, d] (+ mask [B, T]) -> what the score needs.

    dual / multi: [B, d]; poly / genpoly: [B, m, d] (code-attended; pass ``codes``
    [m, d]); som: [B, T, d] + mask [B, T]. ``checked``: see :func:`_reduce_tokens`.
    """
    return _reduce_tokens(spec.mention_side, E, mask, codes, "mention_reps", checked)


def entity_reps(spec: ScoreSpec, F: Tensor, mask: Tensor | None, codes: Tensor | None = None,
                checked: bool = False) -> Reps:
    """Entity encoder output F [N, T, d] (+ mask [N, T]) -> what the index stores.

    dual / poly: [N, d]; multi-m / genpoly-m: [N, m, d] + mask [N, m]; som: [N, T, d] +
    mask [N, T]. ``codes`` only for a general spec that reduces the entity side by codes.
    ``checked``: see :func:`_reduce_tokens`.
    """
    return _reduce_tokens(spec.entity_side, F, mask, codes, "entity_reps", checked)


# ------------------------------------------------------------------------ scoring


def _multi(reps: Reps, lead: int, side: Side, what: str, checked: bool = False) -> tuple[Tensor, Tensor | None]:
    """Reps with ``lead`` leading dims -> (vecs [*lead, n, d], mask or None), checked.

    ``checked``: every row of the mask is known to hold a real position (reps of host-checked tokens,
    :func:`_reduce_tokens`): the mask is then kept as it is, without reading it (no check, no
    dropping an all-real mask, no cutting all-padding columns: the same scores, with no wait for the
    device)."""
    vecs, mask = reps
    single = side.count == 1
    if vecs.ndim == lead + 1:
        if not single:
            raise ValueError(f"{what}: one vector per row {tuple(vecs.shape)}, but the spec keeps {side}")
        if mask is not None:
            raise ValueError(f"{what}: a single-vector rep has no mask")
        return vecs.unsqueeze(-2), None
    if vecs.ndim != lead + 2:
        raise ValueError(f"{what}: expected vecs with {lead + 1} or {lead + 2} dims, got {tuple(vecs.shape)}")
    if single or (side.count is not None and vecs.shape[-2] != side.count):
        raise ValueError(f"{what}: {vecs.shape[-2]} vectors per row {tuple(vecs.shape)}, but the spec keeps {side}")
    if mask is not None:
        if mask.shape != vecs.shape[:-1]:
            raise ValueError(f"{what}: mask shape {tuple(mask.shape)} does not match vecs {tuple(vecs.shape)}")
        if not checked:
            if mask.numel() and not bool(mask.any(-1).all()):
                raise ValueError(f"{what}: some row has no real position (mask all False)")
            if bool(mask.all()):
                return vecs, None
            # Columns that are padding in every row cost GEMM work and change nothing.
            keep = int(mask.flatten(0, -2).any(0).nonzero().max()) + 1 if mask.numel() else 0
            vecs, mask = vecs[..., :keep, :], mask[..., :keep]
        # Zeroed padding makes a padded query column contribute exactly 0, and keeps
        # non-finite junk in padded slots out of the soft path's 0 * sim products.
        vecs = vecs.masked_fill(~mask.unsqueeze(-1), 0)
    return vecs, mask


def _reduce(spec: ScoreSpec, sim: Tensor, key_mask: Tensor | None, query_dim: int) -> Tensor:
    """sim [..., keys] (keys last, broadcastable key_mask) -> attend over keys, sum queries."""
    acc = torch.promote_types(sim.dtype, torch.float32)
    if spec.attention == "hard":
        if key_mask is not None:
            sim = sim.masked_fill_(~key_mask, float("-inf"))  # fresh GEMM output, safe in place
        per_query = sim.amax(-1)
    else:
        logits = sim if key_mask is None else sim.masked_fill(~key_mask, float("-inf"))
        per_query = (torch.softmax(logits, dim=-1, dtype=acc) * sim).sum(-1)
    return per_query.sum(query_dim, dtype=acc)


def _at_least_fp32(t: Tensor) -> Tensor:
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def _common(a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
    dt = torch.promote_types(a.dtype, b.dtype)
    return a.to(dt), b.to(dt)


def score_candidates(spec: ScoreSpec, m: Reps, e: Reps, checked: bool = False) -> Tensor:
    """Each mention against its own K candidates (training).

    m: [B, d] or [B, n, d] (+ mask [B, n]); e: [B, K, d] or [B, K, n', d] (+ mask
    [B, K, n']). Returns [B, K] scores, computed in fp32 from half-precision reps: the B x K x d
    product is cheap, and a bf16 score is coarse exactly where NCE's softmax looks (at |s| ~ 700,
    what a random BERT-base gave on the GPU run, bf16 values are 4 apart; at BLINK's ~100, 0.5).
    ``checked``: the reps' masks come from host-checked tokens (see :func:`_multi`).
    """
    mv, mmask = _multi(m, 1, spec.mention_side, "score_candidates: mention reps", checked)
    ev, emask = _multi(e, 2, spec.entity_side, "score_candidates: entity reps", checked)
    if ev.shape[0] != mv.shape[0] or ev.shape[-1] != mv.shape[-1]:
        raise ValueError(f"score_candidates: mention reps {tuple(m.vecs.shape)} and entity reps "
                         f"{tuple(e.vecs.shape)} disagree on batch size or d")
    mv, ev = _common(_at_least_fp32(mv), _at_least_fp32(ev))
    b, k, nj, d = ev.shape
    if spec.direction == "x->y":  # queries: mention columns i; keys: entity columns j
        sim = (mv @ ev.reshape(b, k * nj, d).transpose(1, 2)).view(b, mv.shape[1], k, nj)
        kmask = None if emask is None else emask[:, None]
        return _reduce(spec, sim, kmask, query_dim=1)
    sim = (ev.reshape(b, k * nj, d) @ mv.transpose(1, 2)).view(b, k, nj, mv.shape[1])
    kmask = None if mmask is None else mmask[:, None, None]
    return _reduce(spec, sim, kmask, query_dim=2)


def _score_block(spec: ScoreSpec, mv: Tensor, mmask: Tensor | None, ev: Tensor, emask: Tensor | None) -> Tensor:
    """mv [B, ni, d], ev [P, nj, d] (padding zeroed) -> [B, P], with one GEMM."""
    if spec.direction == "x->y":
        q, qmask, k, kmask = mv, mmask, ev, emask
    else:
        q, qmask, k, kmask = ev, emask, mv, mmask
    (pq, nq, d), (pk, nk, _) = q.shape, k.shape
    keys = k.reshape(pk * nk, d).T
    kmask = None if kmask is None else kmask.view(1, pk, nk)
    if qmask is None:
        sim = (q.reshape(pq * nq, d) @ keys).view(pq, nq, pk, nk)
        out = _reduce(spec, sim, kmask, query_dim=1)
    else:  # queries are only summed, so pack the real ones and skip padded rows
        owner = qmask.nonzero()[:, 0]
        sim = (q[qmask] @ keys).view(-1, pk, nk)
        per_query = _reduce(spec, sim.unsqueeze(1), kmask, query_dim=1)  # [real queries, P]
        out = per_query.new_zeros(pq, pk).index_add_(0, owner, per_query)
    return out if spec.direction == "x->y" else out.T


def score_all(spec: ScoreSpec, m: Reps, e: Reps, chunk_size: int | None = None) -> Tensor:
    """Every mention against every entity of a block (exact index path, mining, eval).

    m: [B, d] or [B, n, d] (+ mask); e: [N, d] or [N, n', d] (+ mask [N, n']).
    Returns [B, N]. Entities are processed ``chunk_size`` at a time (default: as many
    as keep the [B, n, chunk, n'] similarity block under 2^23 elements), so SOM over
    many long entities never materialises more than one block. Padding costs no GEMM
    work: real query columns are packed, and variable-length entities are grouped by
    length so each chunk is cut to its longest member.
    """
    mv, mmask = _multi(m, 1, spec.mention_side, "score_all: mention reps")
    if e.vecs.ndim not in (2, 3) or e.vecs.shape[-1] != mv.shape[-1]:
        raise ValueError(f"score_all: entity reps must be [N, d] or [N, n, d] with d={mv.shape[-1]}, "
                         f"got {tuple(e.vecs.shape)}")
    n_ent = e.vecs.shape[0]
    n_real_queries = mv.shape[0] * mv.shape[1] if mmask is None else int(mmask.sum())
    per_entity = n_real_queries * (e.vecs.shape[1] if e.vecs.ndim == 3 else 1)
    step = chunk_size if chunk_size is not None else max(1, _SIM_BUDGET // max(per_entity, 1))
    if step < 1:
        raise ValueError(f"score_all: chunk_size must be >= 1, got {chunk_size}")
    order = None
    if e.mask is not None and e.mask.shape == e.vecs.shape[:-1] and not bool(e.mask.all()):
        order = torch.argsort(e.mask.sum(-1), stable=True)
    parts = []
    for a in range(0, n_ent, step):
        rows = slice(a, a + step) if order is None else order[a:a + step]
        chunk = Reps(e.vecs[rows], None if e.mask is None else e.mask[rows])
        ev, emask = _multi(chunk, 1, spec.entity_side, "score_all: entity reps")
        q, k = _common(mv, ev)
        parts.append(_score_block(spec, q, mmask, k, emask))
    if not parts:
        acc = torch.promote_types(torch.promote_types(mv.dtype, e.vecs.dtype), torch.float32)
        return mv.new_zeros(mv.shape[0], 0, dtype=acc)
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out if order is None else out[:, torch.argsort(order)]


# --------------------------------------------------------------------------- MIPS


def is_inner_product(spec: ScoreSpec) -> bool:
    """True when s(x, y) = max_i u(x) . v_i(y) for one mention vector u, so FAISS can
    serve it (dual; multi-m; and y->x with a single mention key, where s = u . sum_t F_t)."""
    if spec.mention_side.count != 1:
        return False
    if spec.entity_side.count == 1:
        return True
    return spec.direction == "y->x" or spec.attention == "hard"


def flatten_for_mips(spec: ScoreSpec, reps: Reps) -> MipsVectors:
    """Entity reps -> vectors for a MIPS index plus the entity row owning each.

    dual: [N, d] as is. multi-m: [N, m, d] -> [N*m - padded, d], each owner repeated,
    padded positions dropped (group hits by owner, keep the max). y->x with one mention
    key: each entity's query columns summed into one vector.
    """
    if not is_inner_product(spec):
        raise ValueError(f"{spec} is not a maximum inner product; score it with score_all")
    vecs, mask = reps
    n = vecs.shape[0]
    if vecs.ndim == 2:
        return MipsVectors(vecs, torch.arange(n, device=vecs.device))
    if vecs.ndim != 3 or (mask is not None and mask.shape != vecs.shape[:2]):
        raise ValueError(f"flatten_for_mips: expected [N, n, d] (+ mask [N, n]), got {tuple(vecs.shape)}")
    if mask is None:
        mask = torch.ones(vecs.shape[:2], dtype=torch.bool, device=vecs.device)
    if spec.direction == "y->x":  # one key: attention is trivially 1, s = u . sum_t F_t
        return MipsVectors((vecs * mask.unsqueeze(-1)).sum(1), torch.arange(n, device=vecs.device))
    owners = torch.arange(n, device=vecs.device).unsqueeze(1).expand_as(mask)
    return MipsVectors(vecs[mask], owners[mask])
