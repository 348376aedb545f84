"""Checkpoints at an fsspec URL (``checkpoint.folder: s3://bucket/run/checkpoints``): for clusters without a
shared file system.

Object stores have no rename, so completeness is a commit marker: a checkpoint is written locally as usual
(``step-N.tmp`` under the job's ``output_dir/checkpoints``, hashed while written), then every rank uploads the
files it wrote to ``URL/step-N/``, and after a barrier rank 0 uploads ``trainer_state.json`` last. A step
folder without that object (a save cut off mid-way) is never listed as complete and is deleted before the
same step is saved again. The ``hf/`` export is uploaded to ``URL/hf/``, its mark last. ``keep_last`` prunes complete and partial step folders alike. Resume downloads the
newest complete step into ``output_dir/checkpoints/.fetched-<host>/`` (once per host, by its lowest rank) and
loads it with the same checks as a local one: the seal, the exact file set, the hashes.

Cost: one upload of each rank's own files per save (in the background with an async ``checkpoint.async_mode``)
and one download of the whole checkpoint per host per resume. Needs the ``s3`` extra (s3fs) for ``s3://``.
"""

from __future__ import annotations

import re
from pathlib import Path

from headrace.training.errors import JobInputError

_STEP_DIR = re.compile(r"^step-(\d{8})$")


def is_url(folder: str | Path) -> bool:
    return "://" in str(folder)


def filesystem(url: str):
    """``(fsspec filesystem, path inside it)`` for ``url``; a missing protocol package is one line."""
    import fsspec  # deferred: local checkpoints never need it

    try:
        return fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise JobInputError(
            f"checkpoint.folder {url}: {e} (s3:// needs the s3 extra: pip install 'headrace[s3]')"
        ) from None


def join(url: str, *names: str) -> str:
    return "/".join([url.rstrip("/"), *names])


def step_folders(url: str, state_file: str, *, complete_only: bool) -> list[str]:
    """The ``step-N`` folders under ``url`` (complete ones: holding ``state_file``), oldest first."""
    fs, root = filesystem(url)
    if not fs.exists(root):
        return []
    fs.invalidate_cache(root)
    names = sorted(p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False))
    steps = [n for n in names if _STEP_DIR.match(n)]
    if complete_only:
        steps = [n for n in steps if fs.exists(join(root, n, state_file))]
    return [join(url, n) for n in steps]


def remove(url: str) -> None:
    fs, path = filesystem(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def upload(local_dir: Path, names: list[str], url: str) -> None:
    """``local_dir/name`` to ``url/name`` for each of ``names``; a failure is one line naming the file."""
    fs, root = filesystem(url)
    for name in names:
        try:
            fs.put_file(str(local_dir / name), join(root, name))
        except OSError as e:
            raise JobInputError(
                f"checkpoint: cannot upload {local_dir / name} to {join(url, name)}: {e.strerror or e}"
            ) from None


def upload_tree(local_dir: Path, url: str, *, last: str) -> None:
    """Every file under ``local_dir`` to ``url`` (whatever was there removed first), ``last`` after all others: a
    reader that finds ``last`` finds the rest (the ``hf/`` export, whose mark is written last)."""
    remove(url)
    names = sorted(p.relative_to(local_dir).as_posix() for p in local_dir.rglob("*") if p.is_file())
    upload(local_dir, [n for n in names if n != last], url)
    upload(local_dir, [last], url)


def download(url: str, local_dir: Path) -> Path:
    """Every file of step folder ``url`` into ``local_dir`` (emptied first); returns ``local_dir``."""
    import shutil

    fs, root = filesystem(url)
    shutil.rmtree(local_dir, ignore_errors=True)
    local_dir.mkdir(parents=True)
    for path in fs.ls(root, detail=False):
        name = path.rstrip("/").rsplit("/", 1)[-1]
        if "/" in name or name in ("", ".", ".."):
            continue
        fs.get_file(path, str(local_dir / name))
    return local_dir


def prune(url: str, keep_last: int | None, state_file: str, *, written: str) -> None:
    """Every step folder under ``url`` older than the newest ``keep_last`` complete ones up to ``written`` (the
    one just saved, never deleted; partial ones too; a folder of a higher step than ``written`` stays)."""
    complete = [c for c in step_folders(url, state_file, complete_only=True) if c <= written]
    if not keep_last or len(complete) <= keep_last:
        return
    oldest_kept = complete[-keep_last]
    for old in step_folders(url, state_file, complete_only=False):
        if old < oldest_kept:  # zero-padded step numbers: names sort by step
            remove(old)


__all__ = ["download", "filesystem", "is_url", "join", "prune", "remove", "step_folders", "upload", "upload_tree"]
