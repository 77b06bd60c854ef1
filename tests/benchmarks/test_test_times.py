"""benchmarks/test_times.py: a JUnit report's test cases are summed into the directory their
module lives in (classes and nested packages included), largest first."""

from __future__ import annotations


import pytest


REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest">
  <testcase classname="tests.test_engine" name="test_a" time="1.5"/>
  <testcase classname="tests.test_engine.TestGroup" name="test_b" time="2.0"/>
  <testcase classname="tests.models.test_llama" name="test_c" time="10.25"/>
  <testcase classname="tests.models.test_llama.TestParity" name="test_d" time="0.75"/>
  <testcase classname="tests.benchmarks.test_moe_bench" name="test_e" time="0.5"/>
</testsuite></testsuites>
"""


@pytest.fixture(scope="module")
def test_times(load_benchmark):
    return load_benchmark("test_times")


def test_cases_are_summed_per_directory_largest_first(test_times, tmp_path):
    report = tmp_path / "run.xml"
    report.write_text(REPORT)
    table = test_times.times_by_directory(str(report))
    assert list(table) == ["tests/models", "tests", "tests/benchmarks"]
    assert table["tests/models"] == {"tests": 2, "seconds": 11.0}
    assert table["tests"] == {"tests": 2, "seconds": 3.5}
    assert table["tests/benchmarks"] == {"tests": 1, "seconds": 0.5}
