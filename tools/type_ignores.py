"""Every ``# type: ignore`` under src/ carries a reason: a comment after it on the same line.

    x = f()  # type: ignore[attr-defined]  # numpy stubs lack the buffer protocol

Prints the count, and each ignore without a reason; exits 1 if there is one (run by .ci/run).
Comments are read with ``tokenize``, so a ``type: ignore`` inside a string is not counted.

    python tools/type_ignores.py [ROOT ...]      (default: src)
"""

from __future__ import annotations

import io
import pathlib
import re
import sys
import tokenize

IGNORE = re.compile(r"#\s*type:\s*ignore(\[[^\]]*\])?")
REASON = re.compile(r"^\s*#\s*\S")


def ignores(source: str) -> list[tuple[int, bool]]:
    """(line, has a reason) for each ``type: ignore`` comment in ``source``."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        m = IGNORE.search(tok.string)
        if m:
            out.append((tok.start[0], bool(REASON.match(tok.string[m.end():]))))
    return out


def scan(roots: list[pathlib.Path]) -> tuple[int, list[str]]:
    """The number of ignores under ``roots`` and ``path:line`` of those without a reason."""
    total, bare = 0, []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            for line, reasoned in ignores(path.read_text(encoding="utf-8")):
                total += 1
                if not reasoned:
                    bare.append(f"{path}:{line}")
    return total, bare


def main(argv: list[str]) -> int:
    repo = pathlib.Path(__file__).resolve().parents[1]
    roots = [pathlib.Path(a) for a in argv] or [repo / "src"]
    total, bare = scan(roots)
    for where in bare:
        print(f"{where}: type: ignore without a reason (add '  # why' after it)")
    print(f"type: ignore comments: {total}, without a reason: {len(bare)}")
    return 1 if bare else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
