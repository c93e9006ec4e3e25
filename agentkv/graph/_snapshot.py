"""Versioned JSON snapshots of learned state, written atomically."""

from __future__ import annotations

import json
import logging
import os
import stat
import time
import uuid
from pathlib import Path
from typing import Any, NamedTuple

from ._facts import GraphFacts
from ._learner import LearnerConfig, TransitionLearner
from ._timing import SessionTiming
from ._timing_state import export_timing, import_timing

__all__ = ["SNAPSHOT_FORMAT", "SNAPSHOT_VERSION", "LearnedState", "SnapshotError", "load_learned_state",
           "load_snapshot", "restore_snapshot", "save_snapshot", "snapshot_document", "write_snapshot"]

SNAPSHOT_FORMAT = "agentkv.learned-state"
SNAPSHOT_VERSION = 1
MAX_SNAPSHOT_BYTES = 64 * 2**20  # 256 agents' counts take ~1.5 MB

logger = logging.getLogger("agentkv.graph")


class SnapshotError(ValueError):
    """A snapshot that is corrupt, of another format, or of an unsupported version."""


class LearnedState(NamedTuple):
    """What a snapshot restores."""

    learner: TransitionLearner
    facts: GraphFacts
    timing: SessionTiming  # fresh when the snapshot holds none (or a bad one: see ``load_learned_state``)


def save_snapshot(path: str | os.PathLike[str], learner: TransitionLearner, facts: GraphFacts | None = None,
                  timing: SessionTiming | None = None) -> None:
    """Write learner counts (and declared facts, session timing) to ``path`` atomically (temp file + rename)."""
    write_snapshot(path, snapshot_document(learner, facts, timing))


def snapshot_document(learner: TransitionLearner, facts: GraphFacts | None = None,
                      timing: SessionTiming | None = None) -> dict[str, Any]:
    """The snapshot of ``learner`` (and ``facts``, ``timing``): a copy, which neither changes when they do.
    ``timing`` is a top-level key of its own: a loader that predates it ignores it."""
    return {
        "format": SNAPSHOT_FORMAT,
        "version": SNAPSHOT_VERSION,
        "learner": learner.export_state(),
        "facts": None if facts is None else facts.export(),
        "timing": None if timing is None else export_timing(timing),
    }


def write_snapshot(path: str | os.PathLike[str], document: dict[str, Any]) -> None:
    """Write a ``snapshot_document`` to ``path`` atomically (temp file, fsync, rename).

    A symlink at ``path`` stays one (the file it points to is replaced); the file keeps the mode it
    had, and a new one gets the mode ``open`` gives (0666 less the umask), not ``mkstemp``'s 0600.
    """
    target = Path(os.path.realpath(path))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies, as to any new file
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            if target.exists():
                os.fchmod(handle.fileno(), stat.S_IMODE(target.stat().st_mode))
            json.dump(document, handle, separators=(",", ":"))
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # the rename itself survives a power loss once the directory is on disk
        directory = os.open(target.parent, os.O_RDONLY)
    except OSError:  # a platform without directory handles: the old snapshot stays whole at worst
        return
    try:
        os.fsync(directory)
    except OSError:
        pass
    finally:
        os.close(directory)


def load_snapshot(
    path: str | os.PathLike[str], config: LearnerConfig | None = None
) -> tuple[TransitionLearner, GraphFacts]:
    """Read a snapshot written by save_snapshot; raise SnapshotError with the reason otherwise."""
    _, learner, facts = _read(path, config)
    return learner, facts


def load_learned_state(path: str | os.PathLike[str], config: LearnerConfig | None = None) -> LearnedState:
    """``load_snapshot`` plus the session timing. A timing part that is not valid is dropped, with a
    warning, and the timing starts fresh: it is learned again from the traffic within minutes, while
    the counts and the declared graph (which clients may never send again) are kept."""
    document, learner, facts = _read(path, config)
    recorded = document.get("timing")
    timing = SessionTiming()
    if recorded is not None:
        try:
            timing = import_timing(recorded)
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            logger.warning("agentkv: snapshot %s: dropping its session timing (learned again from the traffic), "
                           "keeping its learned counts and declared graph: %s", path, f"{exc!r}"[:500])
    return LearnedState(learner, facts, timing)


def _read(path: str | os.PathLike[str], config: LearnerConfig | None) -> tuple[dict[str, Any], TransitionLearner,
                                                                             GraphFacts]:
    file = Path(path)
    if not file.is_file():  # a FIFO or a device would block the server's start
        raise SnapshotError(f"snapshot {path} is not a regular file")
    try:
        if file.stat().st_size > MAX_SNAPSHOT_BYTES:
            raise SnapshotError(f"snapshot {path} is larger than {MAX_SNAPSHOT_BYTES} bytes")
        document = json.loads(file.read_text(encoding="utf-8"))
    except SnapshotError:
        raise
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: not UTF-8, not JSON, a huge integer
        raise SnapshotError(f"cannot read snapshot {path}: {exc!r}"[:500]) from exc
    if not isinstance(document, dict) or document.get("format") != SNAPSHOT_FORMAT:
        raise SnapshotError(f"{path} is not an agentkv snapshot (format {SNAPSHOT_FORMAT!r} expected)")
    if document.get("version") != SNAPSHOT_VERSION:
        raise SnapshotError(
            f"{path} has snapshot version {document.get('version')!r}; this agentkv reads version {SNAPSHOT_VERSION}"
        )
    learner = TransitionLearner(config)
    facts = GraphFacts()
    try:
        learner.import_state(document["learner"])
        if document.get("facts"):
            recorded = document["facts"]
            facts.declare_graph(
                recorded["nodes"],
                [tuple(e) for e in recorded["edges"]],
                [tuple(e) for e in recorded["conditional_edges"]],
                recorded["entry"],
            )
    except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
        raise SnapshotError(f"{path} is corrupt: {exc!r}"[:500]) from exc
    return document, learner, facts


def restore_snapshot(path: str | os.PathLike[str], config: LearnerConfig | None = None) -> LearnedState | None:
    """The state saved at ``path``; None, to start fresh, when there is none or on any SnapshotError:
    then log why and move the refused file aside (``PATH.refused-<unix time>``: the next save would
    replace it, and it may be a newer agentkv's or worth a look)."""
    if not Path(path).exists():
        return None
    try:
        return load_learned_state(path, config)
    except SnapshotError as exc:
        # a symlink to a file stays, as a save keeps it (one to a FIFO or a device goes itself)
        refused = os.path.realpath(path) if os.path.isfile(path) else path
        kept = Path(f"{refused}.refused-{int(time.time())}")
        try:
            os.replace(refused, kept)
            where = f"kept as {kept}"
        except OSError as move:
            where = f"could not be moved aside ({move}): the next save replaces it"
        logger.warning("agentkv: refusing snapshot, starting with fresh learned state (the file %s): %s", where, exc)
        return None
