"""Measurement: model profiling, the relay benchmark, and the hardware reference points."""
