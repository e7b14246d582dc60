"""Test kit shipped with kvplane: spawn real engine processes, wait on readiness, inject faults."""

from kvplane.testing.procs import Proc, spawn_target, wait_for_line

__all__ = ["Proc", "spawn_target", "wait_for_line"]
