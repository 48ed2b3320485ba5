"""A wheel without the parts a job never loads, stored uncompressed so that xz can compress it well.

    python scripts/slim_wheel.py ray-2.60.0-cp312-cp312-manylinux2014_x86_64.whl OUT_DIR \
        --drop ray/jars/ --drop ray/rllib/ --drop ray/llm/ --drop-suffix .map

writes ``OUT_DIR/<same name>``: every file of the wheel but those under a ``--drop`` prefix or ending in a
``--drop-suffix``, each stored (no deflate: xz then compresses the files themselves, where a deflated zip
would not compress again), and a RECORD rewritten for the files kept, so pip installs it and checks every
hash. ``scripts/gpu_carry.sh`` makes Ray's 79 MB wheel a 30 MB ``.whl.xz`` this way.
"""
from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import sys
import zipfile
from pathlib import Path


def slim_wheel(src: Path, out_dir: Path, drop: tuple[str, ...], drop_suffix: tuple[str, ...]) -> tuple[Path, int, int]:
    """(the slim wheel, files kept, files in the original)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / src.name
    with zipfile.ZipFile(src) as zin:
        every = zin.namelist()
        names = [n for n in every if not n.startswith(drop) and not n.endswith(drop_suffix)]
        # the wheel's own RECORD, at the top level (Ray vendors packages with dist-info folders of their own)
        records = [n for n in names if n.endswith(".dist-info/RECORD") and n.count("/") == 1]
        if len(records) != 1:
            raise ValueError(f"{src}: {len(records)} top-level .dist-info/RECORD files, want one: not a wheel")
        rows = io.StringIO()
        writer = csv.writer(rows, lineterminator="\n")
        with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zout:
            for name in names:
                if name == records[0]:
                    continue
                data = zin.read(name)
                zout.writestr(zin.getinfo(name), data, compress_type=zipfile.ZIP_STORED)
                digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
                writer.writerow([name, f"sha256={digest}", len(data)])
            writer.writerow([records[0], "", ""])
            zout.writestr(records[0], rows.getvalue(), compress_type=zipfile.ZIP_STORED)
    return out, len(names), len(every)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("wheel", type=Path)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--drop", action="append", default=[], help="leave out files under this path prefix")
    ap.add_argument("--drop-suffix", action="append", default=[], help="leave out files ending so")
    args = ap.parse_args(argv)
    out, kept, total = slim_wheel(args.wheel, args.out_dir, tuple(args.drop), tuple(args.drop_suffix))
    print(f"{out}: {kept} of {total} files kept")
    return 0


if __name__ == "__main__":
    sys.exit(main())
