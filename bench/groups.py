"""The groups of rows a bench run measures, in order.

A group is a module of bench/ with NAME (str), run(bench) -> None, which measures
and adds rows through bench.row / bench.error_row (bench/driver.py; time with
bench/harness.py: amortised for chains of small calls, time_step for whole jitted
steps), and optionally add_arguments(parser) for its own flags. To add one, write
bench/<group>.py and list it here; its rows get a table in the report
(bench/report.py) like every op's.
"""
from . import calibration, per_op, prefill, serving, stage, sweep

GROUPS = (calibration, stage, serving, prefill, per_op, sweep)
