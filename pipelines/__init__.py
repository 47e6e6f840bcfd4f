"""Drivers: the schedules, the run API notebooks use, and the ``laminar`` command."""

from pipelines.api import RunHandle, RunInterrupted, resume, submit

__all__ = ["RunHandle", "RunInterrupted", "resume", "submit"]
