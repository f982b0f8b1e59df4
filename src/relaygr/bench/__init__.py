"""Measurement: model profiling, the relay benchmark, and the hardware reference points.

Benchmark layers (each imports only those above it): ``protocol`` (what a measured system
implements) <- ``workload`` (who visits when) <- ``runner`` (open-loop load) <- ``stats`` <-
``search`` / ``alternate`` (which points to measure) <- ``exactness`` / ``report`` / ``limit`` /
``verdict`` / ``plots`` <- ``suite`` <- ``benchmark`` (``run_benchmark``, the entry point).
Nothing here imports a system's internals: modes plug in as ``SystemFactory`` callables.
"""
