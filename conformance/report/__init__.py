"""The run report: report.json (schema 1), report.md, report.html with PNG plots, and compare.

``schema.build_report`` assembles and validates the JSON; ``files.write_report`` puts every
file in one directory (junit.xml comes from pytest's ``--junitxml``);
``compare.compare_reports`` lists what got worse between two runs.
"""
