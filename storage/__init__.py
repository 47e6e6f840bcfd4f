"""Zarr stores of a run and their xarray views. Knows nothing of actors or torch."""

from storage.accessor import LaminarAccessor
from storage.trajectories import (
    StoreError,
    TrajectoryWriter,
    open_run,
    open_runs,
    open_trajectories,
)

__all__ = [
    "LaminarAccessor",
    "StoreError",
    "TrajectoryWriter",
    "open_run",
    "open_runs",
    "open_trajectories",
]
