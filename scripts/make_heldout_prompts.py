"""Write tests/data/heldout_prompts.jsonl: 20 code prompts from standard-library files that
scripts/train_tiny.py holds out of training (split by a hash of the file's path).

Each prompt is the 8 lines of a held-out file that end with its first `def` line after line 30, so a
completion continues a real function. Deterministic: sorted files, fixed rule.

    python scripts/make_heldout_prompts.py [--out tests/data/heldout_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sysconfig
from pathlib import Path

HELDOUT_FRACTION = 0.05  # scripts/train_tiny.py Settings.heldout_fraction
SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def is_heldout(rel: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """The training script's split: the first 8 bytes of sha256(relative path) as a fraction of 2**64."""
    return int.from_bytes(hashlib.sha256(rel.encode()).digest()[:8], "big") / 2 ** 64 < fraction


def prompt_of(text: str) -> str | None:
    lines = text.splitlines()
    for i in range(30, len(lines)):
        if lines[i].lstrip().startswith("def ") and lines[i].rstrip().endswith(":"):
            return "\n".join(lines[max(0, i - 7):i + 1]) + "\n"
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/data/heldout_prompts.jsonl")
    p.add_argument("-n", type=int, default=20)
    args = p.parse_args()
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = sorted(q.relative_to(root).as_posix() for q in root.rglob("*.py")
                  if not SKIP_DIRS.intersection(q.relative_to(root).parts[:-1]))
    rows = []
    for rel in rels:
        if not is_heldout(rel):
            continue
        try:
            prompt = prompt_of((root / rel).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
        if prompt:
            rows.append({"id": rel, "prompt": prompt})
        if len(rows) == args.n:
            break
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts from held-out files of {root} to {args.out}")


if __name__ == "__main__":
    main()
