"""The disk cache's protocol in one process (``headrace.dataio.stream.sources.shardcache``; the S3 tests run it across
processes): a shard held by a map is never evicted, eviction is least recently used first, a dead
download's part file goes first, and a folder is per URL and index."""

import logging
import os
import time

import pytest

from headrace.dataio.shards.index import load_index
from headrace.dataio.stream.sources.shardcache import PARTS, ShardCache, local_name, unlock

from tests.loader_util import make_text_dataset


@pytest.fixture
def data(tmp_path):
    root = tmp_path / "data"
    make_text_dataset(root, [7, 5, 6, 7])  # four shards of 30720 bytes
    index = load_index(str(root))
    sizes = {s.name: s.bytes for s in index.shards}
    assert len(set(sizes.values())) == 1
    return root, index, sizes


def test_held_shards_survive_eviction_and_the_oldest_goes_first(data, tmp_path, caplog):
    root, index, sizes = data
    size = next(iter(sizes.values()))
    cache = ShardCache(str(tmp_path / "cache"), limit=2 * size)
    folder = cache.folder(f"file://{root}", index)
    names = sorted(sizes)

    def get(name):
        path, fd = cache.acquire(folder, name, f"file://{root}/{name}", size, None)
        assert path.read_bytes() == (root / name).read_bytes()
        return fd

    def cached():
        return sorted(p.name for p in folder.iterdir() if p.is_file())

    held = [get(names[0]), get(names[1])]
    with caplog.at_level(logging.WARNING):
        third = get(names[2])  # both others mapped: over the limit, with one warning
    assert cached() == names[:3] and "over the limit" in caplog.text
    for fd in (*held, third):
        unlock(fd)
    time.sleep(0.01)
    unlock(get(names[0]))  # used last: names[1] and names[2] are the oldest now
    unlock(get(names[3]))  # room for one, three cached: the two least recently used go
    assert cached() == [names[0], names[3]]
    held = get(names[0])
    time.sleep(0.01)
    unlock(get(names[3]))  # names[0] is the least recently used, but mapped: names[3] goes instead
    unlock(get(names[1]))
    assert cached() == [names[0], names[1]]
    unlock(held)


def test_a_dead_download_is_removed_first(data, tmp_path):
    root, index, sizes = data
    size = next(iter(sizes.values()))
    cache = ShardCache(str(tmp_path / "cache"), limit=2 * size)
    folder = cache.folder(f"file://{root}", index)
    names = sorted(sizes)
    unlock(cache.acquire(folder, names[0], f"file://{root}/{names[0]}", size, None)[1])
    stale = folder / PARTS / f"{local_name(names[1])}.12345.abcd"
    stale.write_bytes(b"x" * size)  # what a killed downloader leaves (no lock held)
    unlock(cache.acquire(folder, names[2], f"file://{root}/{names[2]}", size, None)[1])
    assert not stale.exists() and (folder / names[0]).exists() and (folder / names[2]).exists()


def test_folder_names(data, tmp_path):
    root, index, _ = data
    cache = ShardCache(str(tmp_path))
    assert cache.folder("s3://a/b", index) != cache.folder("s3://a/c", index)
    index.shards = list(index.shards)  # the loaded table's rows, as objects that can be edited
    index.shards[0].bytes += 1  # re-indexed data: another folder
    assert cache.folder("s3://a/b", index) != ShardCache(str(tmp_path)).folder("s3://a/b", load_index(str(root)))
    assert (
        local_name("sub/../x.tar") == "sub%2F..%2Fx.tar"
        and local_name("..") == "%2E."
        and os.sep not in local_name("a/b")
    )


def test_a_short_object_is_an_error_and_leaves_nothing(data, tmp_path):
    """An object shorter than the index says (rewritten under the index): a ShardFormatError naming it, no
    file under the shard's name, no part file left."""
    from headrace.dataio.stream.sources.storage import ShardFormatError

    root, index, sizes = data
    name = sorted(sizes)[0]
    short = tmp_path / "short"
    short.mkdir()
    (short / name).write_bytes((root / name).read_bytes()[:1000])
    cache = ShardCache(str(tmp_path / "cache"), limit=10 * sizes[name])
    folder = cache.folder(f"file://{short}", index)
    with pytest.raises(ShardFormatError, match=f"{name}.: truncated shard: 1000 bytes, the index says {sizes[name]}"):
        cache.acquire(folder, name, f"file://{short}/{name}", sizes[name], None)
    assert [p for p in folder.rglob("*") if p.is_file() and p.parent.name != ".locks"] == []
