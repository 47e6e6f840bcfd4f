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
"""

from __future__ import annotations

import numpy as np

FINISH_REASONS = ("eos", "stop", "length", "tool_limit", "error")
STATUSES = ("buffered", "consumed", "evicted", "discarded", "filtered")

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
COMMIT_ATTR = "n_committed"  # trajectories visible to readers; token counts alongside
SCHEMA_VERSION = 1
