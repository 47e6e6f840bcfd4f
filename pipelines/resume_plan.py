"""What a resume continues from: the run's own config with the overrides it may take,
its newest usable checkpoint and the plan :mod:`storage.resume` makes of its stores
(:func:`prepare_resume`); refused, naming the fix, when the inputs moved or changed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from laminar.config import (
    RunConfig,
    load_config,
    parse_overrides,
)
from laminar.errors import ConfigError
from pipelines.preflight import preflight
from pipelines.run_dir import (
    LOGPROB_FIELDS,
    PATH_FIELDS,
    PROMPT_FIELDS,
    PROMPT_FINGERPRINT,
    SYNTHETIC_FIELDS,
    _field,
    _is_path,
    _refuse_if_running,
    _sha256,
    _with,
    _write_claimed,
)


def prepare_resume(run_dir: str | Path, overrides: list[str] | tuple[str, ...] = ()):
    """The config, resume plan and run directory to continue ``run_dir`` in place: its
    own ``config.yaml`` with ``overrides``, from its newest checkpoint. Refuses, naming
    the fix, when there is nothing to continue from."""
    from laminar.learner import (
        checkpoint_skipped_versions,
        checkpoint_version,
        newest_checkpoint,
    )
    from storage.metrics import check_metrics_store

    path = Path(run_dir).expanduser().resolve()
    config = path / "config.yaml"
    if not path.is_dir():
        raise ConfigError(
            f"cannot resume {str(path)!r}: "
            + ("it is a file" if path.exists() else "it does not exist")
            + "; give a run directory (the one `laminar run` printed as 'run dir')"
        )
    _refuse_if_running(path, "resume")
    if not config.exists():
        held = [n for n in ("checkpoints", "trajectories.zarr") if (path / n).exists()]
        if held:  # (a run's, its config.yaml deleted or lost in a copy)
            newest = newest_checkpoint(path)
            raise ConfigError(
                f"cannot resume {str(path)!r}: it holds a run ({', '.join(held)}) but its "
                "config.yaml is gone; restore config.yaml from a copy of the run directory "
                "(the run wrote it as it started, with every setting), then resume"
                + (
                    "; or start a new run from its newest checkpoint: laminar run "
                    f"CONFIG --run-dir NEW_DIR {_setting(f'trainer.resume_from={newest}')}"
                    if newest is not None
                    else ""
                )
            )
        raise ConfigError(
            f"cannot resume {str(path)!r}: it has no config.yaml, so it is not a run "
            "directory written by `laminar run`"
        )
    ckpt = newest_checkpoint(path)
    if ckpt is None:
        from pipelines.data_module import resume_hint

        # (its own directory refuses a new run once the run stored anything: the new
        # run goes in another)
        raise ConfigError(f"cannot resume {str(path)!r}; {resume_hint(path)}")
    for key, value in parse_overrides(overrides):
        if key == "run_dir" and (value is None or Path(str(value)).expanduser().resolve() != path):
            raise ConfigError(
                f"cannot resume {str(path)!r} with run_dir={value}: a resume continues "
                "the run in its own directory (as --resume refuses --run-dir); drop that "
                "override, or start a new run in another directory from its checkpoint: "
                f"laminar run {str(config)!r} --run-dir NEW_DIR "
                + _setting(f"trainer.resume_from={ckpt}")
            )
    ran = load_config(config)
    # (the run's relative paths, of a run from before laminar recorded them absolute,
    # found where it read them; task.prompt_file's below, with its bytes checked)
    asked = load_config(config, overrides)
    if any(key == "trainer.resume_from" for key, _ in parse_overrides(overrides)):
        _refuse_resume_from(path, ran, asked, ckpt)
    cfg = _paths_found(path, ran, asked)
    # (null, unless it began from another run: recorded as found, with no --set of it)
    own = ran.trainer.resume_from
    if asked.trainer.resume_from == own:
        own = cfg.trainer.resume_from
    # (set, not --set: a path is not YAML; "runs/exp #2" would lose its " #2")
    trainer = cfg.trainer.model_copy(update={"resume_from": str(ckpt)})
    cfg = cfg.model_copy(update={"trainer": trainer, "run_dir": str(path)})
    if cfg.pipeline.schedule != "laminar":
        asked = (
            f" and --set pipeline.schedule={cfg.pipeline.schedule!r} was given"
            if cfg.pipeline.schedule != ran.pipeline.schedule
            else ""
        )
        raise ConfigError(
            f"cannot resume {str(path)!r} in place: it ran pipeline.schedule="
            f"{ran.pipeline.schedule!r}{asked}, and resuming in place is built for the "
            "laminar schedule; "
            + ("drop that --set, or " if asked and ran.pipeline.schedule == "laminar" else "")
            + "start a new run from its checkpoint: "
            + _new_run(path, ckpt, [f"pipeline.schedule={cfg.pipeline.schedule}"] if asked else [])
        )
    fingerprint = path / PROMPT_FINGERPRINT
    moved = fingerprint.exists()
    # A prompt file moved, or named from elsewhere: its bytes are checked below, where
    # the run recorded them (a run from before it did takes the file on trust). The
    # synthetic task's fields mean nothing beside a file.
    both_files = bool(ran.task.prompt_file and cfg.task.prompt_file)
    unused = {"task.prompt_file", *SYNTHETIC_FIELDS} if both_files else set()
    changed = [
        key for key in PROMPT_FIELDS if _field(cfg, key) != _field(ran, key) and key not in unused
    ]
    if changed:
        raise ConfigError(
            _cannot_resume_with(path, changed, cfg, ran)
            + ", and its stores hold groups of the prompts those made (a resume completes "
            "them by prompt key); drop that --set (override), or train on other data in a "
            "new run from its checkpoint: "
            + _new_run(path, ckpt, [_assignment(cfg, key) for key in changed])
        )
    _refuse_logprob_change(path, ran, cfg, ckpt)
    recorded = _recorded_digest(fingerprint) if moved else None
    cfg, digest = _prompt_file_found(path, ran, cfg, recorded, ckpt)
    now = None if digest is None else f"{digest}  {cfg.task.prompt_file}\n"
    version = checkpoint_version(ckpt)
    # (updates made: a trainer restarted within the run skips version numbers)
    made = version - (checkpoint_skipped_versions(ckpt) or 0)
    if cfg.trainer.steps <= made:
        raise ConfigError(
            f"cannot resume {str(path)!r}: its checkpoint is at version {version}, "
            f"{made} updates made, and trainer.steps={cfg.trainer.steps}; ask for more, "
            f"e.g. {_setting(f'trainer.steps={made + cfg.trainer.steps}')}"
        )
    preflight(cfg)
    check_metrics_store(path)  # (damaged: refused now, not by the writer on the cluster)
    plan = _plan(path, version, ckpt)
    # config.yaml takes the overrides but not this resume's checkpoint: it still repeats
    # the whole run (each resume finds its newest checkpoint itself).
    trainer = cfg.trainer.model_copy(update={"resume_from": own})
    text = cfg.model_copy(update={"trainer": trainer}).to_yaml()
    # (a run from before fingerprints gets one now: later resumes are checked against it)
    files = {config: text, **({fingerprint: now} if now is not None and not moved else {})}
    _write_claimed(path, "resume", files)
    return cfg, plan, path


def _cannot_resume_with(path: Path, changed: list[str], cfg: RunConfig, ran: RunConfig) -> str:
    """The start of a refused resume's message: the ``changed`` settings, as asked
    (``cfg``) and as the run ran them (``ran``)."""
    asked = ", ".join(f"{k}={_field(cfg, k)!r}" for k in changed)
    before = ", ".join(f"{k}={_field(ran, k)!r}" for k in changed)
    return f"cannot resume {str(path)!r} with {asked}: it ran {before}"


def _new_run(path: Path, ckpt: Path | str, sets: Sequence[str] = ()) -> str:
    """The command (and the Python API's overrides) that continues the run in ``path``
    in a new run from its checkpoint ``ckpt``, with the settings ``sets``
    (``key=value``): what a refused resume in place offers instead (``--resume`` takes
    no ``trainer.resume_from``)."""
    import shlex

    fields = [f"trainer.resume_from={ckpt}", *sets]
    config = shlex.quote(str(path / "config.yaml"))
    cli = " ".join(f"--set {shlex.quote(f)}" for f in fields)
    python = ", ".join(map(repr, fields))
    return f"`laminar run {config} --run-dir NEW_DIR {cli}` (from Python: overrides=[{python}])"


def _assignment(cfg: RunConfig, key: str) -> str:
    """``key=value`` of ``cfg``'s ``key``, as ``--set`` takes it back (None: ``null``)."""
    value = _field(cfg, key)
    return f"{key}={'null' if value is None else value}"


def _refuse_resume_from(path: Path, ran: RunConfig, asked: RunConfig, ckpt: Path) -> None:
    """Refuse a resume in place with ``trainer.resume_from`` set to another checkpoint
    than the run began from: the resume takes the run's newest checkpoint, and the
    setting was silently ignored (recorded as the run's own)."""
    given, own = asked.trainer.resume_from, ran.trainer.resume_from
    if given == own or (
        given is not None and own is not None and Path(given).resolve() == Path(own).resolve()
    ):
        return
    raise ConfigError(
        f"cannot resume {str(path)!r} with trainer.resume_from={given}: a resume in place "
        f"continues from the run's newest checkpoint ({ckpt.name}) and takes no "
        "trainer.resume_from; drop that --set (override); to roll back to an earlier "
        "checkpoint of the run, move the later checkpoints/version-* folders aside first, "
        "renaming them (e.g. to version-000014.aside: the resume takes the newest "
        "version-<digits> folder), or start a new run from that checkpoint, which reads "
        f"nothing of this store: {_new_run(path, given)}"
    )


def _refuse_logprob_change(path: Path, ran: RunConfig, cfg: RunConfig, ckpt: Path) -> None:
    """Refuse a resume in place with another :data:`LOGPROB_FIELDS` value: the behavior
    logprobs of the groups its store holds untrained (held again by the buffer) and of
    the partial responses it finishes are of the old temperature's distribution, and the
    trainer would take its own at the new one: every such token's ratio off, silently.
    A new run from the checkpoint reads nothing of this store: every trajectory it
    trains is sampled at the new value."""
    changed = [key for key in LOGPROB_FIELDS if _field(cfg, key) != _field(ran, key)]
    if not changed:
        return
    raise ConfigError(
        _cannot_resume_with(path, changed, cfg, ran)
        + ", and the behavior logprobs its stores hold for the groups not yet trained (held "
        "again by a resume) and for the partial responses it finishes are of that "
        "distribution, while the trainer would take its own at the new value: their "
        "importance ratios would be wrong; drop that --set (override), or change it in a "
        "new run from its checkpoint, which restores the weights, optimizer and prompt "
        "order and reads nothing of this store (what it holds untrained is left out): "
        + _new_run(path, ckpt, [f"{k}={_field(cfg, k)}" for k in changed])
    )


def _plan(path: Path, version: int, ckpt: Path):
    """The resume plan of the run in ``path`` from its checkpoint ``ckpt`` at
    ``version``, once what the resume reads of its store is known to read
    (:func:`storage.trajectories.check_resumable`): damage is refused here, naming the
    array and its chunk, not by the buffer after the cluster has started."""
    import shlex

    from storage.resume import plan_resume
    from storage.trajectories import StoreError, check_resumable

    try:
        try:
            plan = plan_resume(path, version)
        except StoreError:
            check_resumable(path)  # (names the array and its chunk, where that is it)
            raise
        check_resumable(path, plan.readmit)
    except StoreError as e:
        setting = shlex.quote(f"trainer.resume_from={ckpt}")
        config = shlex.quote(str(path / "config.yaml"))
        raise StoreError(
            f"cannot resume {str(path)!r}: {e}; or, with no copy, continue in a new run "
            "from its checkpoint, which reads nothing of this store (what it holds "
            f"untrained is left out): `laminar run {config} --run-dir NEW_DIR --set "
            f"{setting}`"
        ) from e
    return plan


def _recorded_digest(fingerprint: Path) -> str:
    """The sha256 that ``fingerprint`` (``PROMPT_FINGERPRINT``) records."""
    try:
        digest = fingerprint.read_text().split()[0]
    except (OSError, ValueError, IndexError):  # (ValueError: not UTF-8 text)
        digest = ""
    if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise ConfigError(
            f"cannot resume {str(fingerprint.parent)!r}: its {PROMPT_FINGERPRINT} does not "
            "read as the sha256 of task.prompt_file (sha256sum's format: the digest, two "
            "spaces, the path); it is damaged: restore it from a copy, or delete it to take "
            "the prompt file on trust (the resume records it again)"
        )
    return digest


def _started_in(path: Path, ran: RunConfig) -> str | None:
    """The working directory the run in ``path`` was started from, when its
    ``config.yaml`` records ``run_dir`` relative to it (a run started before laminar
    recorded absolute paths, and not resumed since); None: unknown."""
    given = ran.run_dir
    if not given or os.path.isabs(given):
        return None
    parts = Path(os.path.normpath(given)).parts
    if not parts or ".." in parts:
        return None
    if path.parts[-len(parts) :] != parts:  # (moved since, or renamed)
        return None
    return str(Path(*path.parts[: -len(parts)]))


def _tried(path: Path, ran: RunConfig, key: str, given: str) -> list[tuple[str, str]]:
    """Where a resume of the run in ``path`` looks for ``given``, path field ``key``'s
    value, each with why there: a relative one of the run's ``config.yaml`` (a run
    started before laminar recorded absolute paths) where the run started
    (:func:`_started_in`), then in this working directory; one given now (an
    override), in this working directory; an absolute one, as it is."""
    from_config = given == _field(ran, key)
    if given.startswith("~"):  # (as given: read where it is read, ~ that machine's home)
        return [(given, "~ as this user's home")]
    if os.path.isabs(given):
        return [(given, "as config.yaml records it" if from_config else "as given")]
    tried: list[tuple[str, str]] = []
    start = _started_in(path, ran) if from_config else None
    if start is not None:
        tried.append((os.path.join(start, given), "where the run was started"))
    tried.append((os.path.abspath(given), "from this working directory"))
    return list(dict(tried).items())


def _not_found(
    path: Path, ran: RunConfig, key: str, given: str, tried: list[tuple[str, str]], what=""
) -> ConfigError:
    """A resume of the run in ``path`` refused: path field ``key``'s ``given`` is in none
    of the places ``tried``; ``what`` says more of what it must hold."""
    kind = "file" if key == "task.prompt_file" else "folder"
    named = ", ".join(f"{p!r} ({why})" for p, why in tried)
    return ConfigError(
        f"cannot resume {str(path)!r}: {key} {given!r} is not a {kind}: tried {named}; "
        f"give the path of the {kind} the run read{what}, e.g. "
        + _setting(f"{key}=/path/to/{Path(given).name}")
        + (
            ", or resume from the directory the run was started in"
            if given == _field(ran, key) and not os.path.isabs(given)
            else ""
        )
    )


def _paths_found(path: Path, ran: RunConfig, cfg: RunConfig) -> RunConfig:
    """``cfg`` with its path fields but ``task.prompt_file`` (:func:`_prompt_file_found`)
    found as the run read them (:func:`_tried`) and made absolute. ``model.path`` found
    nowhere is refused, naming the places tried; ``trainer.resume_from`` found nowhere
    is kept as given (a record: a resume reads its own checkpoint); another path found
    nowhere is taken where it was looked for first (a folder the run makes,
    ``sft.cache_dir``; a file that is checked where it is read, and named there)."""
    for key in PATH_FIELDS:
        given = _field(cfg, key)
        if key == "task.prompt_file" or not _is_path(key, given):
            continue
        tried = _tried(path, ran, key, given)
        found = [p for p, _ in tried if os.path.exists(p)]
        if not found and key == "model.path":
            raise _not_found(path, ran, key, given, tried, " (a local HF folder)")
        if found or key != "trainer.resume_from":
            cfg = _with(cfg, key, os.path.abspath((found or [tried[0][0]])[0]))
    return cfg


def _prompt_file_found(
    path: Path, ran: RunConfig, cfg: RunConfig, recorded: str | None, ckpt: Path
) -> tuple[RunConfig, str | None]:
    """``cfg`` with its ``task.prompt_file`` found and made absolute, and the file's
    sha256 (None: no prompt file). A relative path is looked for as the run read it: one
    of the run's ``config.yaml`` (a run started before laminar recorded absolute paths)
    where the run started (:func:`_started_in`), then in this working directory; one
    given now (an override), in this working directory. Of the files found, the first
    whose bytes are those the run began with (``recorded``; None: not recorded, the
    first found). Refuses, naming the field, every path tried and the fix, when none is
    there or none holds those bytes."""
    given = cfg.task.prompt_file
    if not given:
        return cfg, None
    tried = _tried(path, ran, "task.prompt_file", given)
    bytes_ = f"sha256 {recorded}, as {PROMPT_FINGERPRINT} in the run directory records"
    found = [p for p, _ in tried if os.path.isfile(p)]
    if not found:
        raise _not_found(
            path,
            ran,
            "task.prompt_file",
            given,
            tried,
            (f" (its bytes: {bytes_})" if recorded else ""),
        )
    digests = {p: _sha256(p) for p in found}
    match = next((p for p in found if recorded is None or digests[p] == recorded), None)
    if match is None:
        read = "; ".join(
            f"{p!r} ({why}) has sha256 {digests[p]}" for p, why in tried if p in digests
        )
        raise ConfigError(
            f"cannot resume {str(path)!r}: task.prompt_file {given!r} is not what the run "
            f"began with (its bytes changed since: {read}; it began with {bytes_}), "
            "and the stores hold groups of its prompts by key; put the run's file back (or "
            "give its copy's path: "
            + _setting(f"task.prompt_file=/path/to/{Path(given).name}")
            + "), or train on the new one in a new run from its checkpoint: "
            + _setting(f"trainer.resume_from={ckpt}")
        )
    task = cfg.task.model_copy(update={"prompt_file": os.path.abspath(match)})
    return cfg.model_copy(update={"task": task}), digests[match]


def _setting(field: str) -> str:
    """How to set ``field`` (``key=value``) from either door: the CLI's ``--set`` and
    the Python API's ``overrides``."""
    return f"--set {field} (from Python: overrides=[{field!r}])"
