"""README's benchmark table, made from bench/RESULTS.md's goals so the two cannot disagree.

``make bench`` runs it after writing RESULTS.md (``make bench-table`` alone): the rows of
RESULTS.md's "## Goals" table whose goal starts with one of :data:`README_GOALS`, in that
order, copied as they are, replace what stands between the README's two markers (the README
stays a front door of 150 lines: the rest of the goals are in RESULTS.md).
``tests/unit/test_bench_table.py`` checks the README holds exactly this.

    python bench/readme_table.py            # rewrite README.md
    python bench/readme_table.py --check    # exit 1 if README.md is not what it would write
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- bench-table: made by bench/readme_table.py from bench/RESULTS.md; do not edit -->"
END = "<!-- /bench-table -->"
#: The goals the README shows (each the start of a goal in RESULTS.md), in its order.
README_GOALS = (
    "B1 no-op ≤ ½ × raw horovod",
    "B1T torch no-op, warm",
    "B1T torch no-op, every rank a fresh process",
    "B11 backend=torch: ≤ 0.1 s per extra rank",
    "B12 recovery with 1.01 GB of state",
    "B10 HF Trainer throughput",
    "B2T torch_batches ≥ 1.2 × petastorm",
    "B14 local disk: bytes per rank",
)


def goal_rows(results: str) -> list[str]:
    """The rows of the "## Goals" table of RESULTS.md's text."""
    rows, inside = [], False
    for line in results.splitlines():
        if line.startswith("## "):
            inside = line.strip() == "## Goals"
            continue
        if inside and line.startswith("| ") and not line.startswith(("| goal |", "|---")):
            rows.append(line)
    return rows


def table(results: str) -> str:
    """The README's block (markers included) for RESULTS.md's text."""
    rows = goal_rows(results)
    chosen = [next((row for row in rows if row[2:].startswith(goal)), None)
              for goal in README_GOALS]
    lines = [START, "| goal | measured | met |", "|---|---|---|",
             *(row for row in chosen if row is not None), END]  # a comment line ends a table
    return "\n".join(lines)


def with_table(readme: str, results: str) -> str:
    """``readme`` with its block replaced by the one made from ``results``."""
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no benchmark block: put {START} and {END} where it goes")
    head, rest = readme.split(START, 1)
    _, tail = rest.split(END, 1)
    return head + table(results) + tail


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="exit 1 if README.md differs from what would be written")
    args = parser.parse_args(argv)
    readme_path = ROOT / "README.md"
    readme = readme_path.read_text(encoding="utf-8")
    new = with_table(readme, (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8"))
    if args.check:
        return 0 if new == readme else 1
    if new != readme:
        readme_path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
