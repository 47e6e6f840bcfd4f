"""The partial-response pool's journal records as the recovery log's rows, and back:
:func:`journal_rows` (records to the rows of :class:`storage.partial_log.PartialLogWriter`,
the tokens as ndarrays), :func:`encode_meta` and :func:`revive_meta` (a request's
``meta``, its :class:`~laminar.contract.PromptGroup` included, as JSON and back).

Apart from :mod:`laminar.partial_core` and :mod:`laminar.partial` because it is the log's
format, not the pool's bookkeeping: the core encodes its journal with it, the actor's
thread its writes, and :func:`laminar.partial.replay_log` decodes with it. Import these
from :mod:`laminar.partial`, which re-exports them.
"""

from __future__ import annotations

import dataclasses
import json
from array import array

import numpy as np

from laminar.contract import PromptGroup


def journal_rows(records: list[tuple]) -> dict[str, list[dict]]:
    """:meth:`PartialCore.drain_records` or :meth:`~PartialCore.snapshot_records` as the
    rows of :class:`storage.partial_log.PartialLogWriter` (safe in a thread while the pool
    goes on: the tokens a record refers to do not change)."""
    out: dict[str, list[dict]] = {"requests": [], "chunks": [], "events": []}
    params_json: dict[int, str] = {}  # (a rollout's requests share their parameters)

    def chunk(seq, rid, owner, offset, t, toks, lps, tvs, n) -> None:
        end = offset + n
        out["chunks"].append(
            {
                "seq": seq,
                "request_id": rid,
                "owner": owner,
                "offset": offset,
                "t": t,
                "tokens": _ndarray(toks[offset:end]),
                "logprobs": _ndarray(lps[offset:end]),
                "token_versions": _ndarray(tvs[offset:end]),
            }
        )

    def event(seq, rid, kind, owner, reason, t) -> None:
        out["events"].append(
            {
                "seq": seq,
                "request_id": rid,
                "kind": kind,
                "owner": owner,
                "finish_reason": reason,
                "t": t,
            }
        )

    for table, seq, *f in records:
        if table == "chunks":
            chunk(seq, *f)
        elif table == "events":
            event(seq, *f)
        elif table == "kept":
            out["requests"].append({**f[0], "seq": seq})
        else:
            rid, owner, version, seed, t_start, n_moves, params, meta, prompt = f[:9]
            t, toks, lps, tvs, n, finished, held = f[9:]
            if id(params) not in params_json:
                params_json[id(params)] = json.dumps(_fields(params))
            out["requests"].append(
                {
                    "seq": seq,
                    "request_id": rid,
                    "owner": owner,
                    "version": version,
                    "seed": seed,
                    "t_start": t_start,
                    "n_moves": n_moves,
                    "params": params_json[id(params)],
                    "meta": encode_meta(meta),
                    "prompt_tokens": prompt,
                }
            )
            if n:
                chunk(seq + 1, rid, owner, 0, t, toks, lps, tvs, n)
            if finished is not None:
                event(seq + 2, rid, "finished", owner, *finished)
            if held:
                event(seq + 3, rid, "held", owner, "", t)
    return out


def _ndarray(a: array) -> np.ndarray:
    # (A copy: an ndarray is no object the garbage collector tracks, an array is, and a
    # write's tens of thousands of them would trigger full collections, each a pause of
    # the pool's event loop too.)
    return np.frombuffer(a.tobytes(), a.typecode)


def _fields(obj) -> dict:
    # (dataclasses.asdict deep-copies: these hold only numbers, strings and tuples of them)
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def encode_meta(meta: dict) -> str:
    """A request's ``meta`` as JSON (its :class:`PromptGroup` as a tagged object)."""

    def default(obj):
        if isinstance(obj, PromptGroup):
            return {"__prompt_group__": _fields(obj)}
        raise TypeError(f"request meta holds a {type(obj).__name__}, which the log cannot store")

    return json.dumps(meta, default=default)


def revive_meta(meta):
    """:func:`encode_meta`'s JSON, decoded, with its :class:`PromptGroup` back."""
    if isinstance(meta, list):
        return [revive_meta(v) for v in meta]
    if not isinstance(meta, dict):
        return meta
    g = meta.get("__prompt_group__")
    if g is None:
        return {k: revive_meta(v) for k, v in meta.items()}
    samples = g["samples"]
    return PromptGroup(
        **g
        | {
            "prompt_tokens": tuple(g["prompt_tokens"]),
            "samples": None if samples is None else tuple(samples),
        }
    )
