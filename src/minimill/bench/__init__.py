"""Benchmark commands: each prints its figure beside the figure it is compared with."""
