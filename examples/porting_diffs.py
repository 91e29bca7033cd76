"""Keep docs/porting.md's diffs equal to the example files.

Each `<!-- diff A B -->` line in the doc is followed by a ```diff block holding the
unified diff of example A (plain PyTorch) against B (converted to hetrain).

    python examples/porting_diffs.py          # rewrite the blocks from the files
    python examples/porting_diffs.py --check  # exit 1 if a block is stale (the tests do this)
"""
from __future__ import annotations

import difflib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "porting.md"
_BLOCK = re.compile(r"(<!-- diff (\S+) (\S+) -->\n```diff\n)(.*?)(```)", re.S)


def unified(a: str, b: str) -> str:
    old = (ROOT / a).read_text().splitlines()
    new = (ROOT / b).read_text().splitlines()
    return "".join(line + "\n" for line in difflib.unified_diff(old, new, a, b, lineterm=""))


def render(doc: str) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + unified(m.group(2), m.group(3)) + m.group(5), doc)


def blocks(doc: str) -> list[tuple[str, str, str]]:
    """(plain file, converted file, diff text in the doc) for every block."""
    return [(m.group(2), m.group(3), m.group(4)) for m in _BLOCK.finditer(doc)]


def main(argv: list[str]) -> int:
    doc = DOC.read_text()
    fresh = render(doc)
    if "--check" in argv:
        stale = [a for a, b, text in blocks(doc) if text != unified(a, b)]
        if stale:
            print(f"{DOC}: diffs out of date for {', '.join(stale)}; run python examples/porting_diffs.py")
            return 1
        return 0
    DOC.write_text(fresh)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
