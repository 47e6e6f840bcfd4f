"""The on-disk schema of ``trajectories.zarr``: names, dtypes and dimensions, defined once.

Per-trajectory fields live on the ``trajectory`` dimension. Ragged fields are flat values
on a token dimension plus ``<group>_start``/``<group>_len`` per trajectory:

============  ====================  ===================================================
group         dimension             fields
============  ====================  ===================================================
``prompt``    ``prompt_token``      ``prompt_tokens``
``response``  ``response_token``    ``response_tokens``, ``behavior_logprobs``, ``loss_mask``
``versions``  ``version_token``     ``token_versions`` (empty unless a trajectory mixes versions)
============  ====================  ===================================================

Leave events (:data:`EVENT_FIELDS`, on the ``event`` dimension) update a stored
trajectory's status, ``sample_version``, ``t_sample``, ``t_leave`` and ``leave_version``.
"""

from __future__ import annotations

import numpy as np

FINISH_REASONS = ("eos", "stop", "length", "tool_limit", "error")
STATUSES = ("buffered", "consumed", "evicted", "discarded", "filtered", "dropped")

# Schedules (the store's ``schedule`` attribute) whose responses may mix weight versions,
# one per token in ``token_versions``; in every other, a trajectory has one version.
MIXED_VERSION_SCHEDULES = ("partial_rollout",)

TRAJECTORY_DIM = "trajectory"
# Variable-length UTF-8 in Zarr (has a v3 spec, unlike fixed-width unicode).
STRING = np.dtypes.StringDType()

# name -> numpy dtype of the per-trajectory fields
SCALARS: dict[str, np.dtype] = {
    "uid": STRING,
    "prompt_uid": STRING,
    "prompt_key": np.dtype("int64"),
    "sample_idx": np.dtype("int32"),
    "group_size": np.dtype("int32"),
    "behavior_version": np.dtype("int32"),
    "finish_version": np.dtype("int32"),
    "sample_version": np.dtype("int32"),
    "reward": np.dtype("float32"),
    "finish_reason": STRING,
    "rollout_ids": STRING,
    "n_migrations": np.dtype("int32"),
    "t_submit": np.dtype("float64"),
    "t_start": np.dtype("float64"),
    "t_finish": np.dtype("float64"),
    "t_insert": np.dtype("float64"),
    "t_sample": np.dtype("float64"),
    "status": STRING,
    # when it left the buffer and the trainer's version then, whatever its status (for
    # one consumed, t_sample and sample_version); NaN and -1 while buffered
    "t_leave": np.dtype("float64"),
    "leave_version": np.dtype("int32"),
}

# ragged group -> (token dimension, {field: dtype}); the first field sets the lengths
RAGGED: dict[str, tuple[str, dict[str, np.dtype]]] = {
    "prompt": ("prompt_token", {"prompt_tokens": np.dtype("int32")}),
    "response": (
        "response_token",
        {
            "response_tokens": np.dtype("int32"),
            "behavior_logprobs": np.dtype("float32"),
            "loss_mask": np.dtype("uint8"),
        },
    ),
    "versions": ("version_token", {"token_versions": np.dtype("int32")}),
}

RAGGED_FIELDS: dict[str, str] = {f: g for g, (_, fs) in RAGGED.items() for f in fs}
ALL_FIELDS: tuple[str, ...] = (*SCALARS, *RAGGED_FIELDS)

# The leave events: a trajectory is stored when the buffer admits it (status
# ``buffered``); when it leaves later (consumed, evicted, …) an event is appended rather
# than the record rewritten. Readers apply the events in order (the last one wins).
EVENT_DIM = "event"
EVENT_FIELDS: dict[str, str] = {  # event array -> the trajectory field it sets
    "event_uid": "uid",
    "event_status": "status",
    "event_sample_version": "sample_version",
    "event_t_sample": "t_sample",
    "event_t_leave": "t_leave",
    "event_leave_version": "leave_version",
}
# When and at which trainer version a trajectory left the buffer (any status): stores of
# schema 3 on. An older store's read as left_as_sampled() says; a writer opening one
# adds them so (storage.trajectories.TrajectoryWriter).
LEAVE_FIELDS = ("t_leave", "leave_version")
LEAVE_SCHEMA = 3
EVENT_COMMIT_ATTR = "n_committed_events"

COMMIT_ATTR = "n_committed"  # trajectories visible to readers; token counts alongside
# 3: every trajectory that left records when and at which version (LEAVE_FIELDS);
# 2: trajectories are stored on admission and leave events follow (1: stored on leaving,
# no events). 1 and 2 are still read, and a writer takes a store of 2 on as 3.
SCHEMA_VERSION = 3
READABLE_SCHEMA_VERSIONS = (1, 2, 3)


def left_as_sampled(
    status: np.ndarray, t_sample: np.ndarray, sample_version: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``t_leave`` and ``leave_version`` as a store without them (schema 1 and 2) knows
    them: a consumed trajectory left when it was sampled, at its ``sample_version``;
    for any other, unknown (NaN, -1). Also what a writer gives a consumed record or leave
    event that names neither.

    >>> t, v = left_as_sampled(np.array(["consumed", "evicted"]), np.array([5.0, 9.0]),
    ...                        np.array([3, -1]))
    >>> t.tolist(), v.tolist()
    ([5.0, nan], [3, -1])
    """
    consumed = np.asarray(status) == "consumed"
    t = np.where(consumed, np.asarray(t_sample, np.float64), np.nan)
    v = np.where(consumed, np.asarray(sample_version), -1).astype(SCALARS["leave_version"])
    return t, v
