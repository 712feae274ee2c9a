"""nbkit.cluster.compose: parts pushed beside a gs:// cache (the GCS emulator) composed server-side into
one cache that pull, verify and read-through read, with no sample byte through the driver."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

import engine_calls
import nbkit
from fixtures_gcs import gcs, gcs_emulator, gcs_server, short_gcsfs_retries
from nbkit import format as fmt
from nbkit.cluster import compose as composing
from nbkit.cluster.compose import compose, parts_url
from nbkit.cluster.part import part_generation, part_name
from nbkit.errors import CorruptCacheError
from sources import DictSource, assert_equal

N = 40
CUTS = [0, 5, 13, 20, 31, 40]  # 5 parts of uneven sizes; DictSource has heap leaves (str, bytes)


@pytest.fixture(scope="module")
def local_parts(tmp_path_factory):
    """The parts of a DictSource(40) cache, each a small nbkit cache of its slice, built with the public
    engine on local slices; their fingerprint is the whole source's, as a build's parts carry."""
    base = tmp_path_factory.mktemp("parts")
    src = DictSource(N)
    whole = nbkit.CachedDataset(src, str(base / "whole-meta"))  # only for the source's fingerprint
    fingerprint = fmt.read_meta(whole.root)["fingerprint"]
    whole.close()
    parts = {(start, stop): engine_calls.make_part(src, start, stop, str(base / part_name(start, stop)), fingerprint)
             for start, stop in zip(CUTS, CUTS[1:])}
    return src, parts


def push_parts(local_parts, url, storage_options, skip=()):
    _, parts = local_parts
    for (start, stop), root in parts.items():
        if (start, stop) not in skip:
            nbkit.push(root, f"{parts_url(url)}/{part_name(start, stop)}", storage_options=storage_options)


class Wire:
    """Every gcsfs request of this process (the driver): what it named, sent and received."""

    def __init__(self, monkeypatch):
        import gcsfs
        self.requests = []
        original = gcsfs.GCSFileSystem._request
        wire = self

        async def counted(fs, method, path, *args, **kwargs):
            status, headers, info, contents = await original(fs, method, path, *args, **kwargs)
            data = kwargs.get("data")
            sent = len(data) if isinstance(data, (bytes, bytearray, memoryview)) else 0
            if data is not None and hasattr(data, "getbuffer"):
                sent = data.getbuffer().nbytes
            sent += len(json.dumps(kwargs["json"])) if kwargs.get("json") is not None else 0
            wire.requests.append((method, path, args, {k: v for k, v in kwargs.items() if k not in ("data", "json")},
                                  sent, len(contents or b"")))
            return status, headers, info, contents

        monkeypatch.setattr(gcsfs.GCSFileSystem, "_request", counted)

    def objects(self):
        """(method, object name, bytes sent, bytes received) of the requests that name an object."""
        out = []
        for method, path, args, kwargs, sent, got in self.requests:
            name = kwargs.get("name") or (args[1] if len(args) > 1 else "")
            out.append((method, path, str(name), kwargs, sent, got))
        return out


def test_compose_moves_no_sample_byte_and_every_reader_reads_it(gcs, local_parts, monkeypatch, tmp_path):
    src, _ = local_parts
    url = f"{gcs.url}/caches/dict"
    push_parts(local_parts, url, gcs.storage_options)
    monkeypatch.setattr(composing, "MAX_SOURCES", 2)  # 5 parts: a tree of composes, as 33+ parts would need
    wire = Wire(monkeypatch)
    report = compose(url, storage_options=gcs.storage_options)
    monkeypatch.undo()  # stop counting: what follows is the test's own reading
    assert report.length == N and report.parts == 5 and not report.already
    assert set(report.composed) >= {"col-0.bin", fmt.HEAP}
    assert report.compose_requests > len(report.composed)  # intermediates were needed

    sample_names = set(report.composed)
    sample_bytes = sum(gcs.fs.size(f"{url}/{n}") for n in sample_names)
    received = sent = 0
    for method, path, name, kwargs, out, got in wire.objects():
        base = name.rsplit("/", 1)[-1]
        if base in sample_names or ".compose/" in name:
            assert kwargs.get("alt") != "media" and "upload" not in path and "uploadType" not in kwargs, (method, path, name)
            assert got < 4096 and out < 4096  # the object's JSON description, not its bytes
        received += got
        sent += out
    # What did travel: the parts' manifest, nbkit.json and index.bin; listings and compose requests (JSON);
    # index.bin, manifest.json and nbkit.json written.
    assert sent < report.written + 64 * 1024
    assert report.written < sample_bytes
    print(f"compose: {sample_bytes} sample bytes composed; through the driver: sent {sent}, received {received} "
          f"in {len(wire.requests)} requests; wrote {report.written}")
    assert gcs.fs.ls(f"{parts_url(url)}/{composing.SCRATCH}") == [] if gcs.fs.exists(f"{parts_url(url)}/{composing.SCRATCH}") else True

    copy = str(tmp_path / "copy")
    nbkit.pull(url, copy, storage_options=gcs.storage_options)
    ds = nbkit.CachedDataset(src, copy)  # the source's fingerprint matches: no rebuild
    assert ds.verify() == N
    for i in range(N):
        assert_equal(ds[i], src[i], f"sample {i}")
    rt = nbkit.CachedDataset.open(url, local_max_bytes=1 << 20, storage_options=gcs.storage_options)
    for i in (0, 4, 5, 19, 20, 39):
        assert_equal(rt[i], src[i], f"read-through sample {i}")
    rt.close()
    ds.close()
    assert compose(url, storage_options=gcs.storage_options).already  # a rerun over a published cache: nothing


def test_a_missing_part_is_refused_naming_the_indices(gcs, local_parts):
    url = f"{gcs.url}/caches/gap"
    push_parts(local_parts, url, gcs.storage_options, skip={(13, 20)})
    with pytest.raises(ValueError, match=r"no part holds the indices \[13, 20\).*a column needs every row"):
        compose(url, storage_options=gcs.storage_options)
    assert not gcs.fs.exists(f"{url}/{fmt.META}")


def test_a_part_of_another_source_is_refused(gcs, local_parts, tmp_path):
    url = f"{gcs.url}/caches/mixed"
    push_parts(local_parts, url, gcs.storage_options, skip={(31, 40)})
    other = nbkit.CachedDataset(torch.utils.data.Subset(DictSource(N, with_none=False), range(31, 40)), str(tmp_path / "o"))
    other.warmup()
    other.close()
    nbkit.push(other.root, f"{parts_url(url)}/{part_name(31, 40)}", storage_options=gcs.storage_options)
    with pytest.raises(CorruptCacheError, match=r"0000000000031-0000000000040: its schema differs"):
        compose(url, storage_options=gcs.storage_options)


def test_a_part_whose_index_points_outside_its_heap_is_refused(gcs, local_parts, tmp_path):
    url = f"{gcs.url}/caches/bad"
    push_parts(local_parts, url, gcs.storage_options, skip={(5, 13)})
    bad = str(tmp_path / "bad")
    shutil.copytree(local_parts[1][(5, 13)], bad)
    rec = np.fromfile(os.path.join(bad, fmt.INDEX), fmt.RECORD)
    rec["off"][3] = 1 << 40
    rec.tofile(os.path.join(bad, fmt.INDEX))
    nbkit.push(bad, f"{parts_url(url)}/{part_name(5, 13)}", storage_options=gcs.storage_options)
    with pytest.raises(CorruptCacheError, match=r"index.bin points outside its \d+-byte heap"):
        compose(url, storage_options=gcs.storage_options)


@pytest.mark.parametrize("fail_at", ["merge:1", "merge:3", "merge:last", "write:index.bin", "write:manifest.json",
                                     "write:nbkit.json", "check"])
def test_a_driver_killed_mid_compose_leaves_no_cache_and_a_rerun_finishes(gcs, local_parts, monkeypatch, tmp_path, fail_at):
    """The driver dies at each step: no reader sees a cache (no nbkit.json: pull refuses, naming why),
    and a rerun composes the same cache."""
    src, _ = local_parts
    url = f"{gcs.url}/caches/killed"
    push_parts(local_parts, url, gcs.storage_options)
    monkeypatch.setattr(composing, "MAX_SOURCES", 2)

    class Killed(BaseException):
        pass

    import gcsfs
    kind, _, what = fail_at.partition(":")
    calls = []
    if kind == "merge":
        original = gcsfs.GCSFileSystem.merge

        def merge(fs, path, paths, **kw):
            calls.append(path)
            if what != "last" and len(calls) == int(what):
                raise Killed()
            if what == "last" and path.endswith(fmt.HEAP):
                raise Killed()
            return original(fs, path, paths, **kw)
        monkeypatch.setattr(gcsfs.GCSFileSystem, "merge", merge)
    elif kind == "write":
        original_write = composing.write_bytes

        def write(fs, path, data):
            if path.endswith("/" + what):
                raise Killed()
            return original_write(fs, path, data)
        monkeypatch.setattr(composing, "write_bytes", write)
    else:
        def check(*args):
            raise Killed()
        monkeypatch.setattr(composing, "engine_for", lambda *a, **k: nbkit.cluster.engine.ExecutorEngine(
            _Inline(check), workers=1))
    with pytest.raises(Killed):
        compose(url, storage_options=gcs.storage_options)
    monkeypatch.undo()
    assert not gcs.fs.exists(f"{url}/{fmt.META}")
    with pytest.raises(FileNotFoundError, match="holds no complete nbkit cache"):
        nbkit.pull(url, str(tmp_path / "early"), storage_options=gcs.storage_options)
    report = compose(url, storage_options=gcs.storage_options)
    assert report.length == N and not report.already
    copy = str(tmp_path / "copy")
    nbkit.pull(url, copy, storage_options=gcs.storage_options)
    ds = nbkit.CachedDataset.open(copy)
    assert ds.verify() == N
    for i in range(0, N, 3):
        assert_equal(ds[i], src[i], f"sample {i}")
    ds.close()


class _Inline:
    """An executor that runs nothing but ``fn`` (raising as the driver's death would)."""

    def __init__(self, fn):
        self.fn = fn

    def submit(self, *args):
        self.fn(*args)

    def shutdown(self, **kw):
        pass


def test_compose_needs_gs():
    with pytest.raises(ValueError, match="needs a gs:// cache"):
        compose("memory://b/c")


@pytest.mark.slow
def test_a_driver_killed_at_each_request_leaves_no_half_cache_and_a_rerun_finishes(gcs, local_parts, tmp_path):
    """A real process runs compose and is killed (os._exit(137)) before its k-th request to the endpoint,
    for every request that changes the bucket and some reads: the prefix is no cache until nbkit.json is
    written, and a rerun composes it whole."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(here)), here]))
    options = json.dumps(gcs.storage_options)
    src, _ = local_parts
    template = f"{gcs.url}/template"
    push_parts(local_parts, template, gcs.storage_options)

    def run(url, k):
        log = str(tmp_path / f"requests-{k}.jsonl")
        proc = subprocess.run([sys.executable, os.path.join(here, "killed_at_request.py"), str(k), log, "compose", url, options],
                              env=env, capture_output=True, text=True, timeout=120)
        with open(log) as f:
            return proc.returncode, [json.loads(line) for line in f]

    def fresh(name):
        url = f"{gcs.url}/{name}"
        gcs.fs.copy(f"{parts_url(template)}/", f"{parts_url(url)}/", recursive=True)  # server-side copies
        gcs.fs.invalidate_cache()
        return url

    rc, requests = run(fresh("whole"), 0)
    assert rc == 0, requests
    from urllib.parse import unquote
    # The request that makes nbkit.json visible: the last of its upload (a resumable upload's final POST).
    publish = max(i for i, (m, p, name) in enumerate(requests) if m == "POST" and unquote(p + name).endswith("/" + fmt.META)
                  or f"/{fmt.META}&" in unquote(p)) + 1
    changing = [i + 1 for i, (m, p, name) in enumerate(requests) if m != "GET"]
    assert publish == max(changing)  # nbkit.json is the last thing written
    if os.environ.get("NBKIT_CRASH") == "all":  # make crash: every request
        points = list(range(1, len(requests) + 1))
    else:  # the CI budget: every upload (index.bin, manifest.json, nbkit.json), the first, a middle and the
        # last compose, just after publishing, and 3 reads (checking the parts)
        uploads = [k for k in changing if "upload" in requests[k - 1][1]]
        composes = [k for k in changing if requests[k - 1][1].endswith("/compose")]
        reads = [k for k in range(1, len(requests) + 1) if k not in changing]
        points = sorted({*uploads, composes[0], composes[len(composes) // 2], composes[-1], publish + 1,
                         *reads[:: max(1, len(reads) // 3)][:3]} - {len(requests) + 1})
    for k in points:
        url = fresh(f"killed-{k}")
        rc, _ = run(url, k)
        assert rc == 137 or (rc == 0 and k > publish), (k, rc)  # after publishing, a run may make a request less
        gcs.fs.invalidate_cache()
        published = gcs.fs.exists(f"{url}/{fmt.META}")
        assert published == (k > publish), (k, publish)
        if not published:
            with pytest.raises(FileNotFoundError, match="holds no complete nbkit cache"):
                nbkit.pull(url, str(tmp_path / f"early-{k}"), storage_options=gcs.storage_options)
        with ThreadPoolExecutor(2) as pool:
            report = compose(url, storage_options=gcs.storage_options, engine=pool)
        assert report.already == published
        copy = str(tmp_path / f"copy-{k}")
        nbkit.pull(url, copy, storage_options=gcs.storage_options)  # checks every sha256 and every sample's CRC
        ds = nbkit.CachedDataset.open(copy)
        assert len(ds) == N and ds.verify() == N
        assert_equal(ds[N - 1], src[N - 1])
        ds.close()
    print(f"compose: {len(requests)} requests, {len(points)} kill points")


@pytest.mark.parametrize("cluster", ["dask_engine", "ray_engine"])
def test_parts_built_on_a_cluster_compose_into_the_cache(gcs, local_parts, cluster, request, tmp_path):
    """Workers of a real local cluster (2 workers) build and push the parts; compose's checks run on them too."""
    engine = request.getfixturevalue(cluster)
    src, _ = local_parts
    url = f"{gcs.url}/caches/{cluster}"
    fingerprint = json.loads(open(os.path.join(next(iter(local_parts[1].values())), fmt.META)).read())["fingerprint"]
    futures = [engine.submit(engine_calls.build_and_push_part, src, start, stop, url, gcs.storage_options, fingerprint)
               for start, stop in zip(CUTS, CUTS[1:])]
    built = [f.result(timeout=300) for f in futures]
    assert len({pid for _, _, pid in built}) >= 1 and all(pid != os.getpid() for _, _, pid in built)
    report = compose(url, storage_options=gcs.storage_options, engine=engine)
    assert report.length == N
    copy = str(tmp_path / "copy")
    nbkit.pull(url, copy, storage_options=gcs.storage_options)
    ds = nbkit.CachedDataset(src, copy)
    assert ds.verify() == N
    for i in range(N):
        assert_equal(ds[i], src[i], f"sample {i}")
    ds.close()


def test_two_drivers_composing_at_once_write_the_same_cache(gcs, local_parts, tmp_path):
    """Both drivers compose and publish; what they write is byte-identical (the generation is the parts'
    hash, not a random id), so the cache is whole and a reader that opened after the first publish is
    not made stale by the second."""
    import threading
    from concurrent.futures import ThreadPoolExecutor
    src, _ = local_parts
    url = f"{gcs.url}/caches/twice"
    push_parts(local_parts, url, gcs.storage_options)
    barrier = threading.Barrier(2)
    results = []

    def driver():
        barrier.wait()
        with ThreadPoolExecutor(2) as pool:
            results.append(compose(url, storage_options=gcs.storage_options, engine=pool))

    threads = [threading.Thread(target=driver) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(results) == 2
    first = gcs.fs.cat_file(f"{url}/{fmt.META}")
    copy = str(tmp_path / "copy")
    nbkit.pull(url, copy, storage_options=gcs.storage_options)
    ds = nbkit.CachedDataset(src, copy)
    assert ds.verify() == N
    assert_equal(ds[N - 1], src[N - 1])
    ds.close()
    # the same parts composed elsewhere: the same nbkit.json, byte for byte
    other = f"{gcs.url}/caches/twice-elsewhere"
    gcs.fs.copy(f"{parts_url(url)}/", f"{parts_url(other)}/", recursive=True)
    with ThreadPoolExecutor(2) as pool:
        compose(other, storage_options=gcs.storage_options, engine=pool)
    assert gcs.fs.cat_file(f"{other}/{fmt.META}") == first


@pytest.mark.slow
def test_storage_unreachable_mid_compose_is_named_and_a_rerun_finishes(gcs_emulator, short_gcsfs_retries, local_parts,
                                                                        monkeypatch, tmp_path):
    """The endpoint dies after the first server-side compose: the error names the endpoint and the fix,
    nothing is published, and once it is back a rerun finishes."""
    import gcsfs
    from concurrent.futures import ThreadPoolExecutor
    src, _ = local_parts
    bucket = gcs_emulator.make_bucket()
    url = f"{bucket.url}/caches/unreachable"
    push_parts(local_parts, url, gcs_emulator.storage_options)
    original = gcsfs.GCSFileSystem.merge
    calls = []

    def merge(fs, path, paths, **kw):
        calls.append(path)
        if len(calls) == 2:
            gcs_emulator.kill()
        return original(fs, path, paths, **kw)

    monkeypatch.setattr(gcsfs.GCSFileSystem, "merge", merge)
    with pytest.raises(OSError, match=r"cannot reach the endpoint 127\.0\.0\.1:\d+") as info:
        compose(url, storage_options=gcs_emulator.storage_options, engine="processes")
    assert "rerun the build" in str(info.value)
    monkeypatch.setattr(gcsfs.GCSFileSystem, "merge", original)
    gcs_emulator.start()
    assert not gcs_emulator.fs().exists(f"{url}/{fmt.META}")
    with ThreadPoolExecutor(2) as pool:
        assert compose(url, storage_options=gcs_emulator.storage_options, engine=pool).length == N
    copy = str(tmp_path / "copy")
    nbkit.pull(url, copy, storage_options=gcs_emulator.storage_options)
    ds = nbkit.CachedDataset.open(copy)
    assert ds.verify() == N
    ds.close()


hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given
from hypothesis import strategies as st

from nbkit.errors import UnsafeArchiveError
from nbkit.transfer.manifest import MANIFEST, manifest_bytes, parse_manifest


@pytest.fixture(scope="module")
def memory_part(local_parts):
    """The part [5, 13) pushed to memory:// (the part reader is the same on any fsspec filesystem)."""
    import fsspec
    root = "/nbkit-fuzz-part/" + part_name(5, 13)
    nbkit.push(local_parts[1][(5, 13)], "memory://" + root)
    fs = fsspec.filesystem("memory")
    files = {name: fs.cat_file(f"{root}/{name}") for name in fs.ls(root, detail=False) for name in [name.rsplit("/", 1)[-1]]}
    return fs, root, files


@pytest.mark.fuzz
@given(target=st.sampled_from([fmt.INDEX, fmt.META, MANIFEST, "col-0.bin"]),
       edits=st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), min_size=1, max_size=6),
       cut=st.one_of(st.none(), st.integers(0, 4096)), rehash=st.booleans())
def test_fuzz_a_damaged_part_is_refused_or_read_correctly(memory_part, target, edits, cut, rehash):
    """Any byte of a part's index, metadata, manifest or column changed (with its manifest entry made to
    match, or not): the part reader raises a clean nbkit error naming the part, or returns records that
    are all stored and point inside the heap. Never anything else."""
    import hashlib
    fs, root, files = memory_part
    where = "memory:/" + root
    raw = bytearray(files[target])
    for at, value in edits:
        if raw:
            raw[at % len(raw)] = value
    raw = bytes(raw[:cut])
    damaged = dict(files, **{target: raw})
    if rehash and target != MANIFEST:
        m = parse_manifest(files[MANIFEST], "fixture")
        m["files"][target] = {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}
        damaged[MANIFEST] = manifest_bytes(m)
    try:
        for name, data in damaged.items():
            fs.pipe_file(f"{root}/{name}", data)
        try:
            part = composing._read_part(fs, root, where, 5, 13)
        except (CorruptCacheError, UnsafeArchiveError) as e:
            assert part_name(5, 13) in str(e)
        else:
            heap = part.manifest["files"].get(fmt.HEAP, {"size": 0})["size"]
            assert len(part.records) == 8 and (part.records["state"] == 1).all()
            used = (part.records["flags"] & (fmt.FLAG_VAR | fmt.FLAG_FREEFORM)) != 0
            assert (part.records["off"][used] + part.records["len"][used] <= heap).all()
    finally:
        for name, data in files.items():
            fs.pipe_file(f"{root}/{name}", data)


def upload_part(root, url, start, stop, cache_generation, cache_length, storage_options, renamed_from=None):
    """Upload a local part as nbkit.cluster.part writes one for gs://: data files first, then nbkit.json
    carrying the part manifest (the ``part`` field), no manifest.json; its generation derived from its range
    (``renamed_from``: from another range, as a part renamed to this one with its range fields edited)."""
    import hashlib
    from nbkit.transfer.remote import url_to_fs
    fs, _ = url_to_fs(url, storage_options)
    prefix = f"{parts_url(url)}/{part_name(start, stop)}".split("://", 1)[1]
    meta = json.loads(open(os.path.join(root, fmt.META)).read())
    files = {}
    for name in sorted(os.listdir(root)):
        if name in (fmt.META, fmt.LOCK):
            continue
        data = open(os.path.join(root, name), "rb").read()
        files[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        fs.pipe_file(f"{prefix}/{name}", data)
    meta["part"] = {"cache_generation": cache_generation, "cache_length": cache_length, "start": start, "stop": stop,
                    "files": files}
    meta["generation"] = part_generation(cache_generation, *(renamed_from or (start, stop)))
    fs.pipe_file(f"{prefix}/{fmt.META}", json.dumps(meta).encode())
    fs.invalidate_cache()


def test_parts_with_a_part_manifest_compose_into_the_cache_of_their_generation(gcs, local_parts, tmp_path):
    """The format nbkit.cluster.part writes: nbkit.json's 'part' field is the manifest; the composed cache
    takes the build's generation and length, and a missing last part is named (its length is known)."""
    src, parts = local_parts
    generation = "ab" * 16
    url = f"{gcs.url}/caches/manifested"
    for (start, stop), root in parts.items():
        if stop != N:
            upload_part(root, url, start, stop, generation, N, gcs.storage_options)
    with pytest.raises(ValueError, match=r"no part holds the indices \[31, 40\)"):
        compose(url, storage_options=gcs.storage_options)
    upload_part(parts[(31, 40)], url, 31, 40, generation, N, gcs.storage_options)
    report = compose(url, storage_options=gcs.storage_options, remove_parts=True)
    assert report.length == N
    assert not gcs.fs.exists(parts_url(url))
    meta = json.loads(gcs.fs.cat_file(f"{url}/{fmt.META}"))
    assert meta["generation"] == generation and "part" not in meta and meta["length"] == N
    copy = str(tmp_path / "copy")
    nbkit.pull(url, copy, storage_options=gcs.storage_options)
    ds = nbkit.CachedDataset(src, copy)
    assert ds.verify() == N
    for i in range(N):
        assert_equal(ds[i], src[i], f"sample {i}")
    ds.close()


def test_a_part_of_another_build_generation_is_refused(gcs, local_parts):
    _, parts = local_parts
    url = f"{gcs.url}/caches/two-builds"
    for (start, stop), root in parts.items():
        upload_part(root, url, start, stop, ("cd" if start == 13 else "ab") * 16, N, gcs.storage_options)
    with pytest.raises(CorruptCacheError, match=r"part-0000000000013-0000000000020: its cache_generation differs"):
        compose(url, storage_options=gcs.storage_options)


def test_a_part_renamed_to_another_range_is_refused(gcs, local_parts):
    """Issue 37: the CRCs and sha256s prove a part's bytes, not its indices; its derived generation ties it
    to its range, so the samples of [5, 13) uploaded as [13, 20) (range fields edited) are never composed."""
    _, parts = local_parts
    url = f"{gcs.url}/caches/renamed"
    for (start, stop), root in parts.items():
        upload_part(root, url, start, stop, "ab" * 16, N, gcs.storage_options,
                    renamed_from=(20, 27) if start == 13 else None)
    with pytest.raises(CorruptCacheError, match=r"part-0000000000013-0000000000020/nbkit.json: its generation is not "
                                                r"the one derived from \[13, 20\)"):
        compose(url, storage_options=gcs.storage_options)


def test_a_part_whose_manifest_misstates_a_file_is_refused(gcs, local_parts):
    _, parts = local_parts
    url = f"{gcs.url}/caches/misstated"
    for (start, stop), root in parts.items():
        upload_part(root, url, start, stop, "ab" * 16, N, gcs.storage_options)
    gcs.fs.pipe_file(f"{parts_url(url)}/{part_name(20, 31)}/index.bin".split("://", 1)[1], b"\0" * (11 * 24))
    with pytest.raises(CorruptCacheError, match=r"part-0000000000020-0000000000031/index.bin does not match its manifest"):
        compose(url, storage_options=gcs.storage_options)


def test_parts_of_two_plans_compose_one_exact_cover_of_them(gcs, local_parts, tmp_path):
    """Two drivers with different part sizes uploaded at once: every index is in two parts. Compose
    takes parts that hold each index once and leaves the others out (they go with the prefix)."""
    from concurrent.futures import ThreadPoolExecutor

    src, _ = local_parts
    url = f"{gcs.url}/caches/two-plans"
    push_parts(local_parts, url, gcs.storage_options)
    extra = engine_calls.make_part(src, 5, 20, str(tmp_path / part_name(5, 20)),
                                   fmt.read_meta(local_parts[1][(0, 5)])["fingerprint"])
    nbkit.push(extra, f"{parts_url(url)}/{part_name(5, 20)}", storage_options=gcs.storage_options)  # overlaps two
    with ThreadPoolExecutor(2) as pool:
        report = compose(url, storage_options=gcs.storage_options, engine=pool, remove_parts=True)
    assert report.parts == 4 and report.length == N  # [0, 5) [5, 20) [20, 31) [31, 40): the fewest ending at each index
    copy = str(tmp_path / "copy")
    nbkit.pull(url, copy, storage_options=gcs.storage_options)
    ds = nbkit.CachedDataset(src, copy)
    assert ds.verify() == N and not gcs.fs.exists(parts_url(url))
    for i in (0, 5, 12, 19, 20, N - 1):
        assert_equal(ds[i], src[i])
    ds.close()
