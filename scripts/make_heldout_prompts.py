"""Write tests/data/heldout_prompts.jsonl: 20 code prompts from standard-library files that
scripts/train_tiny.py holds out of training (split by a hash of the file's path).

Each prompt is the 8 lines of a held-out file that end with its first `def` line after line 30, so a
completion continues a real function; the training script evaluates its drafter on prompts made by that rule
(`train_tiny.heldout_prompts`), repeated texts included. Here a prompt whose text an earlier file gave is
skipped: five codec modules of the standard library share the same 8 lines, and an evaluation over them would
count one prompt five times. Deterministic: sorted files, fixed rule.

    python scripts/make_heldout_prompts.py [--out tests/data/heldout_prompts.jsonl]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent.parent / "tests/data/heldout_prompts.jsonl")
    p.add_argument("-n", type=int, default=20)
    args = p.parse_args()
    corpus = train_tiny.collect_corpus(train_tiny.Settings.heldout_fraction, 0)
    if args.n < 1:
        p.error(f"-n is {args.n}; allowed: an integer >= 1")
    rows, seen = [], set()
    for rel, prompt in train_tiny.heldout_prompts(corpus, len(corpus.heldout_files)):
        if prompt not in seen and len(rows) < args.n:
            seen.add(prompt)
            rows.append({"id": rel, "prompt": prompt})
    if len(rows) < args.n:
        p.error(f"-n is {args.n}; the held-out files give {len(rows)} distinct prompts: allowed -n <= {len(rows)}")
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    print(f"wrote {len(rows)} prompts from held-out files of {corpus.root} to {args.out}")


if __name__ == "__main__":
    main()
