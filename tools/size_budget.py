"""Size report: module lines and function lengths under src/. A warning, not a gate.

Budgets (the house style): modules should stay under 600 lines and are flagged past 800;
functions over 50 lines are listed for review. A budget that fires is a question ("what are the
two jobs here?"), not a reason to move half a class into another file (issue 29), so the report
exits 0 unless ``--strict`` is given.
"""

from __future__ import annotations

import ast
import pathlib
import sys

SOFT, HARD, FUNC = 600, 800, 50


def main() -> int:
    root = pathlib.Path(__file__).resolve().parents[1] / "src"
    over, long_funcs = [], []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text(encoding="utf-8")
        n = text.count("\n")
        if n > SOFT:
            over.append((n, path.relative_to(root)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > FUNC:
                    long_funcs.append((length, f"{path.relative_to(root)}:{node.lineno} {node.name}"))
    for n, p in sorted(over, reverse=True):
        print(f"module {p}: {n} lines ({'OVER HARD LIMIT' if n > HARD else 'over soft limit'})")
    for n, f in sorted(long_funcs, reverse=True):
        print(f"function {f}: {n} lines")
    hard = [p for n, p in over if n > HARD]
    if hard:
        print(f"warning: {len(hard)} module(s) over {HARD} lines", file=sys.stderr)
        return 1 if "--strict" in sys.argv[1:] else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
