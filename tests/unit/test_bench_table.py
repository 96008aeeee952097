"""README's benchmark table is the one bench/readme_table.py makes from bench/RESULTS.md's goals
(``make bench`` and ``make bench-table`` write it): a number in one and not the other fails."""
from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _table_module():
    spec = importlib.util.spec_from_file_location("readme_table", ROOT / "bench" / "readme_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_readme_table_is_made_from_the_results():
    table = _table_module()
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    results = (ROOT / "bench" / "RESULTS.md").read_text(encoding="utf-8")
    assert table.with_table(readme, results) == readme, \
        "README.md's benchmark table differs from bench/RESULTS.md's goals: run make bench-table"
    shown = [line for line in table.table(results).splitlines() if line.startswith("| B")]
    goals = table.goal_rows(results)
    assert shown and all(line in goals for line in shown)
    assert len(shown) >= len(table.README_GOALS) - 2  # a goal renamed in RESULTS.md is noticed


def test_a_changed_number_is_written_back():
    table = _table_module()
    results = "## Goals\n\n| goal | measured | met |\n|---|---|---|\n" \
              "| B1 no-op ≤ ½ × raw horovod | 0.30 s vs 6.00 s (0.05×) | yes |\n\n## Next\n"
    readme = f"intro\n{table.START}\nold\n{table.END}\nrest\n"
    made = table.with_table(readme, results)
    assert "| B1 no-op ≤ ½ × raw horovod | 0.30 s vs 6.00 s (0.05×) | yes |" in made
    assert made.startswith("intro\n") and made.endswith("\nrest\n") and "old" not in made
