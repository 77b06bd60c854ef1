"""Time per test directory, out of a pytest JUnit XML report, so growth of the suite is visible.

    python -m pytest -q tests -n 2 --dist loadfile --junitxml=run.xml
    python benchmarks/test_times.py run.xml [--json times.json]

Prints, per directory under tests/, the number of tests and the seconds they took (setup, call
and teardown, as JUnit records them; with two workers the directories' seconds add up to about
twice the wall time). Module-scoped fixtures are charged to the first test that uses them, so a
directory's figure includes the engines its modules build.
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ElementTree


def directory_of(classname: str) -> str:
    """'tests.models.test_llama.TestX' or 'tests.models.test_llama' -> 'tests/models'."""
    parts = classname.split(".")
    module_index = next((i for i, part in enumerate(parts) if part.startswith("test_")), len(parts))
    return "/".join(parts[:module_index]) or "tests"


def times_by_directory(report_path: str) -> dict[str, dict[str, float]]:
    totals: dict[str, dict[str, float]] = collections.defaultdict(lambda: {"tests": 0, "seconds": 0.0})
    for case in ElementTree.parse(report_path).getroot().iter("testcase"):
        row = totals[directory_of(case.get("classname", ""))]
        row["tests"] += 1
        row["seconds"] += float(case.get("time", 0.0))
    return dict(sorted(totals.items(), key=lambda item: -item[1]["seconds"]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="pytest --junitxml output")
    parser.add_argument("--json", help="also write the table here")
    args = parser.parse_args()
    table = times_by_directory(args.report)
    print(f"{'directory':<24}{'tests':>7}{'seconds':>10}")
    for directory, row in table.items():
        print(f"{directory:<24}{row['tests']:>7}{row['seconds']:>10.1f}")
    print(f"{'all':<24}{sum(r['tests'] for r in table.values()):>7}"
          f"{sum(r['seconds'] for r in table.values()):>10.1f}")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(table, file, indent=2)


if __name__ == "__main__":
    main()
