"""The loader over the S3 protocol: a moto S3 server on loopback, reached the way users configure it
(``s3://bucket/prefix`` with the endpoint and keys from the standard AWS environment variables), and a
loopback proxy in front of it that injects faults on every Nth request (connection reset, 500/503,
a slow response, a truncated body). An epoch over S3 must equal the same epoch read locally: same
keys, same tensors, each sample exactly once, faults or not."""

import http.client
import http.server
import itertools
import socket
import struct
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.server")

from headrace.dataio import build_loader  # noqa: E402
from headrace.dataio.stream.sources import shard_source, storage  # noqa: E402

from tests.helpers import free_port  # noqa: E402
from tests.loader_util import energon_prepared, make_text_dataset  # noqa: E402

SHARDS = [7, 5, 3, 1, 6]
BUCKET = "corpus"


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    """A moto S3 server on loopback holding ``s3://corpus/text/`` (shards, ``.nv-meta/``, headrace index)
    uploaded from a local copy; yields ``(endpoint, local root, keys)``."""
    import boto3

    root = tmp_path_factory.mktemp("s3text")
    keys = make_text_dataset(root, SHARDS)
    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    client.create_bucket(Bucket=BUCKET)
    upload(endpoint, root, "text")
    try:
        yield endpoint, root, keys
    finally:
        server.stop()


def upload(endpoint: str, root: Path, prefix: str) -> None:
    """Every file under ``root`` to ``s3://BUCKET/prefix/``."""
    import boto3

    client = boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id="testing",
        aws_secret_access_key="testing",
    )
    for path in sorted(root.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), BUCKET, f"{prefix}/{path.relative_to(root).as_posix()}")


@pytest.fixture
def aws_env(monkeypatch):
    """Point the standard AWS environment at an endpoint; s3fs caches filesystems per options, not
    per environment, so its cache is cleared on each change."""
    import s3fs

    def point(endpoint: str) -> None:
        for name, value in {
            "AWS_ENDPOINT_URL": endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
        }.items():
            monkeypatch.setenv(name, value)
        s3fs.S3FileSystem.clear_instance_cache()

    yield point
    s3fs.S3FileSystem.clear_instance_cache()


def epoch(path, options=None, **kw):
    """Every batch of one epoch as ``(keys, tokens, json)`` (``options``: the dataset's storage_options)."""
    dataset = {"path": str(path), **({"storage_options": options} if options else {})}
    config = {"datasets": [dataset], "batch_size": 4, "epochs": 1, "num_workers": 0, "shuffle_window": 4, "seed": 3}
    config.update(kw)
    return [
        (list(b["__key__"]), b["tokens.npy"].numpy().copy(), [j["n"] for j in b["json"]]) for b in build_loader(config)
    ]


def assert_same_epoch(got, want, keys):
    assert [k for b in got for k in b[0]] == [k for b in want for k in b[0]]
    assert sorted(k for b in got for k in b[0]) == sorted(keys)  # each sample exactly once
    for (_, tokens, meta), (_, want_tokens, want_meta) in zip(got, want):
        np.testing.assert_array_equal(tokens, want_tokens)
        assert meta == want_meta


def test_epoch_over_s3_equals_the_local_epoch(s3, aws_env):
    endpoint, root, keys = s3
    aws_env(endpoint)
    want = epoch(root)
    assert_same_epoch(epoch(f"s3://{BUCKET}/text"), want, keys)
    assert_same_epoch(epoch(f"s3://{BUCKET}/text", num_workers=2), want, keys)  # forked workers


def test_endpoint_and_keys_from_storage_options(s3, aws_env, monkeypatch):
    """``storage_options`` of a ``datasets:`` entry reach s3fs: with the environment pointing nowhere,
    the options alone find the server."""
    endpoint, root, keys = s3
    aws_env("http://127.0.0.1:9")  # discard port: nothing listens
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(name)
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    config = {
        "datasets": [{"path": f"s3://{BUCKET}/text", "storage_options": options}],
        "batch_size": 4,
        "epochs": 1,
        "num_workers": 0,
        "shuffle_window": 4,
        "seed": 3,
    }
    got = [k for b in build_loader(config) for k in b["__key__"]]
    assert got == [k for b in epoch(root) for k in b[0]]


def test_energon_dir_and_metadataset_take_storage_options(s3, aws_env, monkeypatch, tmp_path):
    """An energon-prepared directory (energon's sqlite, no headrace index) and a metadataset naming it, on
    S3: ``storage_options`` reach the metadata reads and the shards alike."""
    endpoint, _, keys = s3
    local = tmp_path / "energon"
    assert energon_prepared(local, SHARDS, split_parts_ratio=[("train", 1.0)]) == keys
    (tmp_path / "meta.yaml").write_text(
        "__module__: megatron.energon\n__class__: MetadatasetV2\n"
        "splits: {train: {blend_epochized: [{repetitions: 2, path: energon}]}}\n"
    )
    upload(endpoint, tmp_path, "mds")
    aws_env("http://127.0.0.1:9")  # discard port: only the options find the server
    options = {"endpoint_url": endpoint, "key": "testing", "secret": "testing"}
    assert_same_epoch(epoch(f"s3://{BUCKET}/mds/energon", options), epoch(local), keys)
    twice = epoch(f"s3://{BUCKET}/mds/meta.yaml", options)
    assert sorted(k for b in twice for k in b[0]) == sorted(keys * 2)


class FaultProxy(http.server.ThreadingHTTPServer):
    """Forwards HTTP to ``upstream`` and records every request; request number k (from 1) with
    ``k % every == 0`` gets the next fault of ``faults`` instead of (or on top of) the upstream answer
    (``every=0``: none; ``where``: only requests whose path contains it are numbered). A ``stall`` holds
    the answer for ``stall_s`` (or until ``unstall`` is set)."""

    daemon_threads = True

    def __init__(self, upstream_port: int, faults: list[str], every: int, stall_s: float = 0.0, where: str = ""):
        super().__init__(("127.0.0.1", 0), FaultHandler)
        self.upstream_port, self.faults, self.every = upstream_port, itertools.cycle(faults), every
        self.count, self.injected, self.requests, self.lock = 0, [], [], threading.Lock()
        self.stall_s, self.unstall, self.where = stall_s, threading.Event(), where

    def next_fault(self, method: str, path: str) -> str | None:
        with self.lock:
            self.requests.append((method, path))
            if self.where not in path:
                return None
            self.count += 1
            if not self.every or self.count % self.every:
                return None
            fault = next(self.faults)
            if fault in ("truncate", "stall") and method != "GET":  # a HEAD/PUT has no body to cut short
                return None
            self.injected.append((fault, method, path))
            return fault

    def shard_gets(self) -> dict[str, int]:
        """GET requests per shard (``.tar``) path."""
        with self.lock:
            paths = [path.split("?")[0] for method, path in self.requests if method == "GET"]
        return {p: paths.count(p) for p in sorted(set(paths)) if p.endswith(".tar")}

    def handle_error(self, request, client_address):
        if not isinstance(sys.exc_info()[1], OSError):  # a client that gave up on a stalled answer: expected
            super().handle_error(request, client_address)


class FaultHandler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _forward(self):
        fault = self.server.next_fault(self.command, self.path)
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if fault == "reset":  # RST instead of FIN: the client sees "connection reset by peer"
            self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.close_connection = True
            return
        if fault in ("500", "503"):
            code = int(fault)
            error = (
                b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>"
                + (b"InternalError" if code == 500 else b"SlowDown")
                + b"</Code><Message>injected</Message></Error>"
            )
            self.send_response(code)
            self.send_header("Content-Type", "application/xml")
            self.send_header("Content-Length", str(len(error)))
            self.end_headers()
            self.wfile.write(error)
            return
        if fault == "slow":
            time.sleep(0.2)
        if fault == "stall":  # past the client's read timeout: it gives up and asks again
            self.server.unstall.wait(self.server.stall_s)
        upstream = http.client.HTTPConnection("127.0.0.1", self.server.upstream_port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
        upstream.request(self.command, self.path, body=body, headers=headers)
        resp = upstream.getresponse()
        data = resp.read()
        upstream.close()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("connection", "transfer-encoding", "content-length", "date", "server"):
                self.send_header(k, v)
        # a HEAD answers with the object's length and no body
        self.send_header(
            "Content-Length", resp.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
        )
        self.end_headers()
        if fault == "truncate" and len(data) > 1:  # headers promise the whole body; half of it arrives
            self.wfile.write(data[: len(data) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(socket.SHUT_RDWR)
            return
        if self.command != "HEAD":
            self.wfile.write(data)

    do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _forward


@pytest.fixture
def fault_proxy(s3):
    proxies = []

    def start(faults, every, stall_s=0.0, where=""):
        proxy = FaultProxy(int(s3[0].rsplit(":", 1)[1]), faults, every, stall_s, where)
        threading.Thread(target=proxy.serve_forever, daemon=True).start()
        proxies.append(proxy)
        return proxy

    yield start
    for proxy in proxies:
        proxy.unstall.set()
        proxy.shutdown()
        proxy.server_close()


@pytest.mark.parametrize("faults", [["reset"], ["500", "503"], ["slow", "truncate"]])
def test_faults_are_retried_and_no_sample_is_lost_or_repeated(s3, aws_env, fault_proxy, monkeypatch, faults):
    endpoint, root, keys = s3
    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    monkeypatch.setattr(shard_source, "REMOTE_BLOCK", 4096)  # several ranged GETs a shard: more requests to fault
    proxy = fault_proxy(faults, every=3)
    aws_env(f"http://127.0.0.1:{proxy.server_address[1]}")
    # botocore's own retries (up to 20 s backoff on 503 SlowDown) off: the retries under test are s3fs's and the loader's
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    got = epoch(f"s3://{BUCKET}/text")
    injected = {fault for fault, _, _ in proxy.injected}
    assert injected == set(faults), proxy.injected
    assert_same_epoch(got, epoch(root), keys)


def test_read_timeout_is_retried(s3, aws_env, fault_proxy, monkeypatch):
    """Every 4th GET stalls (30 s) past s3fs's configured read timeout (``storage_options.config_kwargs``):
    the read is given up and asked again, and the epoch is still the local one, each sample once."""
    endpoint, root, keys = s3
    monkeypatch.setattr(storage, "BACKOFF_S", 0.01)
    monkeypatch.setattr(shard_source, "REMOTE_BLOCK", 8192)
    proxy = fault_proxy(["stall"], every=4, stall_s=30)
    aws_env(f"http://127.0.0.1:{proxy.server_address[1]}")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    options = {"config_kwargs": {"read_timeout": 1.0, "connect_timeout": 2}}
    t0 = time.monotonic()
    got = epoch(f"s3://{BUCKET}/text", datasets=[{"path": f"s3://{BUCKET}/text", "storage_options": options}])
    assert time.monotonic() - t0 < 30  # timed out, not waited out
    stalled = [path for fault, _, path in proxy.injected if fault == "stall"]
    asked = [path for method, path in proxy.requests if method == "GET"]
    assert stalled and all(asked.count(path) > stalled.count(path) for path in stalled), proxy.injected
    assert_same_epoch(got, epoch(root), keys)


# -- the local disk cache of remote shards (data.cache_dir / data.cache_limit) ----------------------------


def cached_files(cache_dir: Path) -> dict[str, int]:
    """Complete cached shards (name -> bytes) and, under ``.parts/``, downloads in progress."""
    return {
        p.relative_to(cache_dir).as_posix(): p.stat().st_size
        for p in cache_dir.rglob("*")
        if p.is_file() and ".locks" not in p.parts and p.name != ".lock"
    }


def local_epochs(root, epochs, **kw):
    return [k for b in epoch(root, epochs=epochs, **kw) for k in b[0]]


def test_cache_second_epoch_downloads_nothing(s3, aws_env, fault_proxy, tmp_path):
    endpoint, root, keys = s3
    proxy = fault_proxy([], every=0)
    aws_env(f"http://127.0.0.1:{proxy.server_address[1]}")
    url, cache = f"s3://{BUCKET}/text", tmp_path / "cache"
    got = epoch(url, epochs=2, cache_dir=str(cache))
    want = epoch(root, epochs=2)
    assert [k for b in got for k in b[0]] == [k for b in want for k in b[0]]
    for (_, tokens, meta), (_, want_tokens, want_meta) in zip(got, want):
        np.testing.assert_array_equal(tokens, want_tokens)
        assert meta == want_meta
    shards = sorted(p.name for p in root.glob("*.tar"))
    assert proxy.shard_gets() == {f"/{BUCKET}/text/{name}": 1 for name in shards}  # each once, over 2 epochs
    files = cached_files(cache)
    assert sorted(Path(f).name for f in files) == shards
    assert all(size == (root / Path(f).name).stat().st_size for f, size in files.items())
    # a new loader (as a new run would) with workers: served from the cache, nothing downloaded again
    assert_same_epoch(epoch(url, cache_dir=str(cache), num_workers=2), epoch(root), keys)
    assert sum(proxy.shard_gets().values()) == len(shards)


def test_cache_limit_evicts_least_recently_used(s3, aws_env, fault_proxy, tmp_path, monkeypatch, caplog):
    """A limit of the most bytes one batch's shards take (those are mapped while it is read), below the
    dataset's size: the disk never holds more, shards are evicted and fetched again, the stream is unchanged."""
    from headrace.dataio.shards.index import load_index

    endpoint, root, keys = s3
    monkeypatch.setattr(shard_source, "OPEN_CACHED_SHARDS", 1)
    proxy = fault_proxy([], every=0)
    aws_env(f"http://127.0.0.1:{proxy.server_address[1]}")
    index = load_index(str(root))
    shard_of = dict(zip(keys, index.samples["shard"].tolist()))
    sizes = [(root / s.name).stat().st_size for s in index.shards]
    limit = max(sum(sizes[s] for s in {shard_of[k] for k in b[0]}) for b in epoch(root, epochs=2))
    assert limit < sum(sizes)
    cache = tmp_path / "cache"
    config = {
        "datasets": [{"path": f"s3://{BUCKET}/text"}],
        "batch_size": 4,
        "epochs": 2,
        "num_workers": 0,
        "shuffle_window": 4,
        "seed": 3,
        "cache_dir": str(cache),
        "cache_limit": f"{limit}B",
    }
    got, peak = [], 0
    for batch in build_loader(config):
        got += batch["__key__"]
        peak = max(peak, sum(cached_files(cache).values()))
    assert got == local_epochs(root, 2)
    assert 0 < peak <= limit and sum(cached_files(cache).values()) <= limit
    assert "over the limit" not in caplog.text
    assert sum(proxy.shard_gets().values()) > len(sizes)  # evicted shards came back in epoch 2
    with pytest.raises(ValueError, match=r"data.cache_limit: .* cannot hold shard"):
        build_loader({**config, "cache_limit": max(sizes) - 1})
    with pytest.raises(ValueError, match=r"^data: cache_limit: not a size: 'lots'"):
        build_loader({**config, "cache_limit": "lots"})
    with pytest.raises(ValueError, match=r"^data: cache_limit \(1000000000\) needs cache_dir"):
        build_loader({**config, "cache_limit": "1GB", "cache_dir": None})


RANK = """
import json, sys
from headrace.dataio import build_loader
loader = build_loader(json.loads(sys.argv[1]), dp_rank=1, dp_size=2)
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps([k for b in loader for k in b["__key__"]]))
"""


def test_cache_shared_by_ranks_and_workers(s3, aws_env, fault_proxy, tmp_path):
    """Two ranks (rank 1 in another process, rank 0 here) of two workers each start together on one cache,
    each shard GET slowed down so that they wait on each other's downloads: every shard is downloaded once,
    and every sample is served once, as without the cache."""
    import json
    import subprocess

    endpoint, root, keys = s3
    proxy = fault_proxy(["slow"], every=1, where=".tar")
    aws_env(f"http://127.0.0.1:{proxy.server_address[1]}")
    config = {
        "datasets": [{"path": f"s3://{BUCKET}/text"}],
        "batch_size": 2,
        "epochs": 1,
        "num_workers": 2,
        "shuffle_window": 4,
        "seed": 3,
        "cache_dir": str(tmp_path / "cache"),
    }
    other = subprocess.Popen(
        [sys.executable, "-c", RANK, json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout.readline() == "ready\n"
        other.stdin.write("go\n")
        other.stdin.flush()
        got = [[k for b in build_loader(config, dp_rank=0, dp_size=2) for k in b["__key__"]]]
        got.append(json.loads(other.communicate(timeout=120)[0]))
    finally:
        other.kill()
    assert other.returncode == 0
    local = {**config, "datasets": [{"path": str(root)}], "cache_dir": None, "num_workers": 0}
    for r in range(2):
        assert got[r] == [k for b in build_loader(local, dp_rank=r, dp_size=2) for k in b["__key__"]]
    assert sorted(k for g in got for k in g if k) == sorted(keys)
    shards = sorted(p.name for p in root.glob("*.tar"))
    assert proxy.shard_gets() == {f"/{BUCKET}/text/{name}": 1 for name in shards}
    files = cached_files(tmp_path / "cache")
    assert sorted(Path(f).name for f in files) == shards  # no part file left over


KILLED = """
import json, sys
from headrace.dataio import build_loader
next(iter(build_loader(json.loads(sys.argv[1]))))
"""


def test_killed_download_leaves_no_complete_file(s3, aws_env, fault_proxy, tmp_path, monkeypatch):
    """A process killed (SIGKILL) while its download hangs leaves only its part file; the next run
    removes it and serves the full stream."""
    import json
    import signal
    import subprocess

    endpoint, root, keys = s3
    stalling = fault_proxy(["stall"], every=1, stall_s=60, where=".tar")
    aws_env(f"http://127.0.0.1:{stalling.server_address[1]}")
    cache = tmp_path / "cache"
    config = {
        "datasets": [{"path": f"s3://{BUCKET}/text"}],
        "batch_size": 4,
        "num_workers": 0,
        "epochs": 1,
        "shuffle_window": 4,
        "seed": 3,
        "cache_dir": str(cache),
        "cache_limit": "1MB",
    }
    proc = subprocess.Popen([sys.executable, "-c", KILLED, json.dumps(config)])
    try:
        deadline = time.monotonic() + 60
        while not any(".parts" in f for f in cached_files(cache)) or not stalling.injected:
            assert time.monotonic() < deadline and proc.poll() is None, "the download never started"
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    files = cached_files(cache)
    assert files and all(".parts/" in f for f in files), files  # nothing under a shard's own name
    proxy = fault_proxy([], every=0)
    aws_env(f"http://127.0.0.1:{proxy.server_address[1]}")
    assert_same_epoch(epoch(f"s3://{BUCKET}/text", cache_dir=str(cache), cache_limit="1MB"), epoch(root), keys)
    assert sorted(Path(f).name for f in cached_files(cache)) == sorted(p.name for p in root.glob("*.tar"))
