"""Drivers: the schedules, the run API notebooks use, and the ``laminar`` command."""

from pipelines.api import RunHandle, resume, submit

__all__ = ["RunHandle", "resume", "submit"]
