"""GPU probes: one question each about where time or correctness goes, answered in a recorded run.

Not part of the product. Each module's docstring says what it measures, how to run it
(``python -m bench.probes.NAME`` on the GPU machine) and what it answered, with the run's record.
"""
