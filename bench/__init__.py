"""Latency benchmarks of bcg-diffusion (run with ``python -m bench``)."""
