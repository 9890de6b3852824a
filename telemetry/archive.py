"""The retention archive kept in bounds: old roll-outs deleted, small ones merged.

After each roll-out (``telemetry/retention.py``) the store tidies its archive folder with
:func:`tidy_archive`, in a thread of its own (the writer does not wait for it), in this order:

1. What an interrupted tidy left behind goes (hidden folders, parts a merged folder replaced).
2. Roll-out folders whose cutoff is older than ``max_age_s`` are deleted, whole.
3. Compaction: the roll-outs of one bucket merge into one Parquet dump covering them all. A
   bucket is a UTC hour for roll-outs of the current UTC day and a UTC day for earlier ones
   (by each folder's cutoff). A bucket's folders merge once the bucket is over, and sooner
   when it holds more than :data:`COMPACT_FOLDERS`. One merge takes consecutive folders of at
   most :data:`COMPACT_MAX_BYTES` together, and a folder that large stays as it is, so a merge
   never reads or writes more than that. A day of 30 s roll-outs (2,880 folders) becomes one
   folder per earlier day, one per past hour of today and a few for the current hour.
4. The oldest folders are deleted until the archive folder holds at most ``max_bytes`` (the
   size of every file in it). This is a hard bound: a folder larger than the limit on its own
   is deleted too.

A reader (:func:`~.retention.open_archive`, ``tokenmill diagnose ARCHIVE``) never sees a folder
half written or half deleted. A merged folder is written whole under a hidden (dot) name, with
:data:`~.retention.MERGED_FILE` naming the folders it replaces, and published by a rename; a
reader that lists it beside its parts skips the parts. A folder is deleted by renaming it to a
hidden name first and removing it after; a reader that had listed it reads the archive again.
One store tidies one archive folder: two stores must not share one.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import duckdb

from .dump import DumpError
from .parquet_dump import ParquetDumpError, export_parquet
from .retention import MERGED_FILE, merged_from, read_parts, visible_parts

__all__ = ["COMPACT_FOLDERS", "COMPACT_MAX_BYTES", "Part", "Tidied", "tidy_archive"]

HOUR_NS = 3600 * 10**9
DAY_NS = 24 * HOUR_NS
#: more folders than this in the current bucket (hour) merge before the bucket is over
COMPACT_FOLDERS = 6
#: the most bytes of folders one merge takes; a folder this large is never merged
COMPACT_MAX_BYTES = 64 << 20
_NAME = re.compile(r"^(\d+)-(\d+)")  # a roll-out folder: <first ns>-<cutoff ns>[-m<k>]
_HIDDEN = (".del-", ".merge-", "..merge-")  # what a tidy writes or deletes, before it is done
_EXPORTING = re.compile(r"^\..*\.tmp$")  # export_parquet's folder before it is renamed
_MERGE_ERRORS = (ParquetDumpError, DumpError, duckdb.Error, OSError, KeyError, ValueError)


@dataclass(frozen=True)
class Part:
    """One roll-out folder of the archive (a roll-out, or a merge of them)."""

    path: Path
    first_ns: int
    cutoff_ns: int
    bytes: int


@dataclass
class Tidied:
    """What one :func:`tidy_archive` did, and the archive after it."""

    pruned_folders: int = 0
    pruned_bytes: int = 0
    merges: int = 0
    merged_folders: int = 0  # folders that went into the merges
    folders: int = 0
    bytes: int = 0
    error: str | None = None  # why a merge failed (one line; the rest of the tidy went on)


def tree_bytes(path: Path) -> int:
    """The bytes of every file under the folder ``path``."""
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(root, name)).st_size
    return total


def roll_parts(folder: Path) -> list[Part]:
    """The archive's roll-out folders that readers see, oldest cutoff first."""
    out = []
    for d in visible_parts(folder):
        if m := _NAME.match(d.name):
            out.append(Part(d, int(m[1]), int(m[2]), tree_bytes(d)))
    return sorted(out, key=lambda p: (p.cutoff_ns, p.path.name))


def remove(path: Path) -> None:
    """Delete the folder ``path``: renamed to a hidden name first (readers skip it from then
    on), then removed (a leftover goes at the next tidy)."""
    hidden = path.with_name(f".del-{path.name}")
    os.rename(path, hidden)
    shutil.rmtree(hidden, ignore_errors=True)


def clean_leftovers(folder: Path) -> None:
    """What an interrupted tidy or roll-out left: hidden folders of a merge or a deletion, a
    Parquet export (``.*.tmp``) an hour old, and the parts of a published merged folder not
    yet deleted. (A roll-out may be exporting meanwhile: its own export is younger.)"""
    for d in folder.iterdir():
        if d.is_dir() and (d.name.startswith(_HIDDEN) or _stale_export(d)):
            shutil.rmtree(d, ignore_errors=True)
    shown = {d.name: d for d in folder.iterdir() if d.is_dir() and not d.name.startswith(".")}
    for merged in [d for d in shown.values() if (d / MERGED_FILE).exists()]:
        for name in merged_from(merged):
            if name in shown and name != merged.name:
                remove(shown[name])
        (merged / MERGED_FILE).unlink(missing_ok=True)


def _stale_export(d: Path) -> bool:
    try:
        return bool(_EXPORTING.match(d.name)) and time.time() - d.stat().st_mtime > 3600
    except OSError:
        return False


def bucket(cutoff_ns: int, now_ns: int) -> tuple[int, int]:
    """The compaction bucket ``[start, end)`` of a folder with this cutoff: its UTC hour when
    the cutoff is in the current UTC day, its UTC day before."""
    size = HOUR_NS if cutoff_ns // DAY_NS == now_ns // DAY_NS else DAY_NS
    start = cutoff_ns // size * size
    return start, start + size


def _runs(parts: list[Part], max_bytes: int) -> list[list[Part]]:
    """``parts`` cut into consecutive runs of at most ``max_bytes`` together."""
    runs: list[list[Part]] = [[]]
    for p in parts:
        if runs[-1] and sum(q.bytes for q in runs[-1]) + p.bytes > max_bytes:
            runs.append([])
        runs[-1].append(p)
    return runs


def compaction_groups(
    parts: list[Part],
    now_ns: int,
    *,
    max_folders: int = COMPACT_FOLDERS,
    max_bytes: int = COMPACT_MAX_BYTES,
) -> list[list[Part]]:
    """The folders to merge now, each group into one: per bucket, its folders smaller than
    ``max_bytes`` once the bucket is over (two or more), or while it lasts past ``max_folders``."""
    buckets: dict[tuple[int, int], list[Part]] = {}
    for p in parts:
        if p.bytes < max_bytes:
            buckets.setdefault(bucket(p.cutoff_ns, now_ns), []).append(p)
    groups = []
    for (_, end), small in sorted(buckets.items()):
        if len(small) > max_folders or (end <= now_ns and len(small) > 1):
            groups += [run for run in _runs(small, max_bytes) if len(run) > 1]
    return groups


def _free_name(folder: Path, group: list[Part]) -> str:
    """The merged folder's name: ``<first ns>-<cutoff ns>`` of the union, made unique."""
    name = f"{min(p.first_ns for p in group)}-{max(p.cutoff_ns for p in group)}"
    k, out = 1, name
    while (folder / out).exists():
        k += 1
        out = f"{name}-m{k}"
    return out


def merge(folder: Path, group: list[Part]) -> Path:
    """Merge the folders ``group`` into one Parquet dump of all their rows: written whole
    under a hidden name, published by a rename, then the parts deleted.

    Raises:
        ParquetDumpError, duckdb.Error, OSError, KeyError, ValueError: a part could not be
            read or the merge written (the parts are left as they were), or a part not
            deleted once the merge was published (the next tidy deletes it).
    """
    name = _free_name(folder, group)
    hidden = folder / f".merge-{name}"
    con = read_parts([p.path for p in group], threads=1)
    try:
        export_parquet(con, hidden, overwrite=True)
    finally:
        con.close()
    (hidden / MERGED_FILE).write_text(json.dumps({"parts": [p.path.name for p in group]}) + "\n")
    out = folder / name
    os.rename(hidden, out)  # from here readers see the merge, and skip its parts
    for p in group:
        remove(p.path)
    (out / MERGED_FILE).unlink()
    return out


def _prune(done: Tidied, parts: list[Part]) -> None:
    for p in parts:
        remove(p.path)
        done.pruned_folders += 1
        done.pruned_bytes += p.bytes


def _too_old(parts: list[Part], now_ns: int, max_age_s: float) -> list[Part]:
    return [p for p in parts if p.cutoff_ns < now_ns - max_age_s * 1e9]


def _over_size(parts: list[Part], total: int, max_bytes: int) -> list[Part]:
    """The oldest ``parts`` whose deletion brings ``total`` to ``max_bytes`` or below."""
    out = []
    for p in parts:
        if total <= max_bytes:
            break
        out.append(p)
        total -= p.bytes
    return out


def _compact(folder: Path, done: Tidied, now_ns: int, max_folders: int, max_bytes: int) -> None:
    groups = compaction_groups(
        roll_parts(folder), now_ns, max_folders=max_folders, max_bytes=max_bytes
    )
    for group in groups:
        try:
            merge(folder, group)
        except _MERGE_ERRORS as exc:
            line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            done.error = f"merging {group[0].path.name} and {len(group) - 1} more: {line}"
            return
        done.merges += 1
        done.merged_folders += len(group)


def tidy_archive(
    folder: str | Path,
    now_ns: int,
    *,
    max_age_s: float | None = None,
    max_bytes: int | None = None,
    compact_folders: int = COMPACT_FOLDERS,
    compact_bytes: int = COMPACT_MAX_BYTES,
) -> Tidied:
    """Prune and compact the archive ``folder`` as of ``now_ns`` (see the module's steps).

    Args:
        max_age_s: delete folders whose cutoff is older than this (None: keep them).
        max_bytes: then delete the oldest folders until the archive holds at most this.
        compact_folders, compact_bytes: :func:`compaction_groups`'s ``max_folders`` and
            ``max_bytes``.

    Raises:
        OSError: a folder could not be deleted (a failed merge is ``Tidied.error`` instead).
    """
    p = Path(folder)
    done = Tidied()
    if not p.is_dir():
        return done
    clean_leftovers(p)
    if max_age_s is not None:
        _prune(done, _too_old(roll_parts(p), now_ns, max_age_s))
    _compact(p, done, now_ns, compact_folders, compact_bytes)
    if max_bytes is not None:
        _prune(done, _over_size(roll_parts(p), tree_bytes(p), max_bytes))
    done.folders, done.bytes = len(visible_parts(p)), tree_bytes(p)
    return done
