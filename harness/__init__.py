"""Helpers the tests and the benchmarks share (not part of the installed project): real local
processes on 127.0.0.1 (`harness.processes`)."""
