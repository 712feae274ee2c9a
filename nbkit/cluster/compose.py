"""Merge the parts of a ``gs://`` cache into one cache without moving sample bytes through the driver.

Each part is a small nbkit cache of one contiguous index slice ``[start, stop)`` under
``<url>.parts/part-<start>-<stop>/``: a prefix *beside* the cache, because a cache's own prefix must
stay one flat set of its files (``nbkit.pull`` refuses a subdirectory). A part's ``nbkit.json`` carries
its part manifest (the ``part`` field :mod:`nbkit.cluster.part` writes: the cache's generation and
length, the range, every file's size and sha256) and is uploaded last; a plain pushed cache of the
slice (``manifest.json``) is accepted too. :func:`compose` checks every part (through
:mod:`nbkit.trust`: the listing, the manifest, ``nbkit.json``, the index records), then builds each ``col-<k>.bin`` and ``heap.bin`` by
GCS compose (gcsfs ``merge``), server-side: the parts' files concatenated in index order, in a tree
of at most :data:`MAX_SOURCES` sources a request (GCS's limit), intermediates under
``<url>.parts/.compose/`` deleted after. Worker calls of an :class:`~nbkit.cluster.engine.Engine` read
each composed file once to check that every segment equals its part's sha256 and to hash the whole
for the cache's ``manifest.json``. The driver itself writes only ``index.bin`` (the parts' records,
heap offsets rebased by each part's start in the heap), ``manifest.json`` and, last,
``nbkit.json``: until then no reader (``nbkit.pull``, read-through, the mirror store) sees a cache.
A driver killed at any point reruns from the start and finishes; a rerun over a published cache
returns at once; two drivers composing the same parts at once write the same bytes (the cache's
``generation`` is a hash of its parts), so the later one changes nothing.

Example:
    >>> compose("gs://bucket/caches/mnist", storage_options=opts, engine="processes")  # doctest: +SKIP
    ComposeReport(length=60000, parts=8, ...)
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass

import numpy as np

from .. import format as fmt
from ..errors import CorruptCacheError
from ..transfer.manifest import (MANIFEST, check_entry, check_file_set, check_listing, check_meta_sizes, manifest_bytes,
                                 new_manifest, read_bounded, read_remote_manifest)
from ..transfer.remote import check_bucket, connect, remote_errors, url_to_fs, write_bytes
from .. import trust
from ..trust import check_url
from .engine import engine_for
from .part import PART_SPEC, PartRefused, parse_part_name, part_generation, part_name
from .plan import plan_around

__all__ = ["compose", "ComposeReport", "parts_url", "check_uploaded", "MAX_SOURCES", "check_composed"]

#: GCS composes at most 32 source objects in one request.
MAX_SOURCES = 32
#: Where intermediate composed objects live, under the parts prefix (never under the cache's own).
SCRATCH = ".compose"
#: Bytes a hashing worker reads at a time.
READ_BLOCK = 16 << 20


def parts_url(url: str) -> str:
    """The prefix holding the parts of the cache at ``url``: beside it, never inside it.

    Example:
        >>> parts_url("gs://bucket/caches/mnist/")
        'gs://bucket/caches/mnist.parts'
    """
    return url.rstrip("/") + ".parts"


@dataclass(frozen=True)
class ComposeReport:
    """What :func:`compose` did.

    Attributes:
        length: samples in the composed cache.
        parts: parts composed.
        composed: the files made by server-side compose (``col-<k>.bin``, ``heap.bin``).
        compose_requests: compose requests sent (a tree when a file has more than :data:`MAX_SOURCES` parts).
        written: bytes the driver wrote (``index.bin``, ``manifest.json``, ``nbkit.json``).
        seconds: wall time, of which ``compose_seconds`` checking the parts and composing, and
            ``check_seconds`` the workers reading the composed files against the parts' sha256s.
        already: ``True`` when the cache was already composed and published (nothing was done).
    """

    length: int = 0
    parts: int = 0
    composed: tuple = ()
    compose_requests: int = 0
    written: int = 0
    seconds: float = 0.0
    compose_seconds: float = 0.0
    check_seconds: float = 0.0
    already: bool = False


@dataclass(frozen=True)
class _Part:
    start: int
    stop: int
    root: str  # the part's prefix on fs (no scheme)
    meta: dict
    manifest: dict
    records: np.ndarray
    info: dict | None  # the ``part`` field (None: a plain pushed cache of the slice)


def compose(url: str, *, engine="processes", storage_options: dict | None = None, remove_parts: bool = False,
            callback=None) -> ComposeReport:
    """Compose the parts under :func:`parts_url(url) <parts_url>` into the cache at ``url`` (``gs://`` only).

    Args:
        url: the cache, e.g. ``"gs://bucket/caches/mnist"``.
        engine: what runs the hashing calls (each reads one composed file in the cloud, never in
            the driver): an :class:`~nbkit.cluster.engine.Engine`, a name (``"processes"``, ``"ray"``,
            ``"dask"``) or an executor. An engine given is left open.
        storage_options: passed to gcsfs (the workers get them too).
        remove_parts: delete the parts prefix once the cache is published.
        callback: progress (:mod:`nbkit.progress`): descriptions of the steps.

    Returns:
        A :class:`ComposeReport`.

    Raises:
        ValueError: the parts do not cover every index (columns need every row), or ``url`` is not ``gs://``.
        CorruptCacheError: a part is damaged or does not belong with the others (schema, columns,
            fingerprint), or a composed file does not equal its parts.
    """
    from ..progress import as_callback

    start_time = time.perf_counter()
    url = check_bucket(check_url(url, "url"), "url").rstrip("/")
    if not url.startswith(("gs://", "gcs://")):
        raise ValueError(f"compose needs a gs:// cache (server-side compose is a GCS operation), not {url!r}. "
                         "For a local or shared directory, merge the parts in place (nbkit.cluster's local merge).")
    cb = as_callback(callback)
    purl = parts_url(url)
    fix = f"rerun the build of {url}: it computes only the missing or damaged parts, then composes again"
    fs, rroot = connect(url, storage_options, doing="composing", fix=fix, write=True)
    proot = rroot + ".parts"
    with remote_errors(fs, url, "composing", fix, note=" (nothing was published)"):
        fs.invalidate_cache()
        if fs.exists(f"{rroot}/{fmt.META}"):
            cb.set_description("already composed")
            if remove_parts:
                _remove(fs, proot)
            return ComposeReport(seconds=time.perf_counter() - start_time, already=True)
        cb.set_description(f"checking the parts under {purl}")
        parts = _read_parts(fs, proot, purl)
        first = parts[0]
        length = parts[-1].stop
        columns = [fmt.column_file(k) for k in range(len(first.meta["columns"]))]
        heaps = [p.manifest["files"].get(fmt.HEAP, {"size": 0})["size"] for p in parts]
        has_heap = any(fmt.HEAP in p.manifest["files"] for p in parts)
        # Scratch from a killed run: its intermediates are remade, never trusted.
        _remove(fs, f"{proot}/{SCRATCH}")

        requests = 0
        segments = {}
        for name in columns + ([fmt.HEAP] if has_heap else []):
            cb.set_description(f"composing {name}")
            sources = [(f"{p.root}/{name}", p.manifest["files"][name], p) for p in parts if name in p.manifest["files"]]
            requests += _compose_tree(fs, f"{rroot}/{name}", [s for s, _, _ in sources], f"{proot}/{SCRATCH}/{name}")
            segments[name] = [(e["size"], e["sha256"], p.start, p.stop) for _, e, p in sources]
        _remove(fs, f"{proot}/{SCRATCH}")

    composed_at = time.perf_counter()
    # The one read of the sample bytes, by workers: each composed file against its parts' sha256s.
    cb.set_description("checking the composed files")
    runner = engine_for(engine, workers=min(4, len(segments)) or 1)
    try:
        futures = {name: runner.submit(check_composed, f"{url}/{name}", segs, storage_options)
                   for name, segs in segments.items()}
        shas = {name: f.result() for name, f in futures.items()}
    finally:
        if runner is not engine:
            runner.close()
    checked_at = time.perf_counter()

    records, offset = [], 0
    for part, heap in zip(parts, heaps):
        rec = part.records.copy()
        in_heap = (rec["flags"] & (fmt.FLAG_VAR | fmt.FLAG_FREEFORM)) != 0
        rec["off"][in_heap] += offset
        records.append(rec)
        offset += heap
    index = np.concatenate(records).tobytes()
    meta = {k: v for k, v in first.meta.items() if k not in ("capacity", "max_bytes", "admit_seed", "part")}
    if first.info is not None:
        generation = first.info["cache_generation"]  # the cache's, chosen by the build's plan
    else:
        # Parts without a part manifest (pushed caches of the slices): the generation names the parts
        # composed, not the run, so every driver composing them writes the same bytes.
        ident = hashlib.sha256()
        for p in parts:
            ident.update(f"{p.start}-{p.stop}:".encode() + manifest_bytes(p.manifest))
        generation = ident.hexdigest()[:32]
    # Either way two drivers composing the same parts at once write byte-identical index.bin,
    # manifest.json and nbkit.json, so neither undoes the other.
    meta.update(length=length, generation=generation)
    meta_raw = json.dumps(meta, indent=1, sort_keys=True).encode()
    fmt.parse_meta(meta_raw, f"{url}/{fmt.META}", "")  # what we publish is what every reader accepts
    files = {name: {"size": sum(seg[0] for seg in segs), "sha256": shas[name]} for name, segs in segments.items()}
    files[fmt.INDEX] = {"size": len(index), "sha256": hashlib.sha256(index).hexdigest()}
    files[fmt.META] = {"size": len(meta_raw), "sha256": hashlib.sha256(meta_raw).hexdigest()}
    manifest = manifest_bytes(new_manifest(dict(sorted(files.items())), length, length))

    cb.set_description("publishing")
    with remote_errors(fs, url, "composing", fix, note=" (publishing: the files are composed, the cache is not published yet)"):
        write_bytes(fs, f"{rroot}/{fmt.INDEX}", index)
        write_bytes(fs, f"{rroot}/{MANIFEST}", manifest)
        write_bytes(fs, f"{rroot}/{fmt.META}", meta_raw)  # last: from now on it is a cache
        fs.invalidate_cache()
        if remove_parts:
            _remove(fs, proot)
    cb.set_description("composed")
    return ComposeReport(length=length, parts=len(parts), composed=tuple(segments), compose_requests=requests,
                         written=len(index) + len(manifest) + len(meta_raw), seconds=time.perf_counter() - start_time,
                         compose_seconds=composed_at - start_time, check_seconds=checked_at - composed_at)


def _read_parts(fs, proot: str, purl: str) -> list:
    """Every part under ``proot``, checked, in index order; they must cover ``[0, length)`` exactly once."""
    try:
        entries = fs.ls(proot, detail=True)
    except FileNotFoundError:
        entries = []
    found = []
    for e in entries:
        name = str(e.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
        if e.get("type") != "directory" or name == SCRATCH:
            continue
        bounds = parse_part_name(name)
        if bounds is None:
            raise CorruptCacheError(f"{purl} holds {name!r}, which is not a part (part-<start>-<stop>). Remove it, then "
                                    "compose again.")
        start, stop = bounds
        if stop > fmt.MAX_LENGTH:
            raise CorruptCacheError(f"{purl}/{name}: a part's range must be start < stop <= {fmt.MAX_LENGTH}. Remove it, then compose again.")
        found.append((start, stop, name))
    if not found:
        raise ValueError(f"cannot compose: {purl} holds no parts. Build them first (nbkit.cluster), then compose.")
    # Two plans' parts (another part size, or two drivers at once): the ones that hold each index
    # once are composed, the others left out (removed with the prefix once the cache is published).
    keep = set(plan_around([(a, b) for a, b, _ in found], max(b for _, b, _ in found))[0])
    found = sorted(f for f in found if f[:2] in keep)
    parts = [_read_part(fs, f"{proot}/{name}", f"{purl}/{name}", start, stop) for start, stop, name in found]
    infos = [p.info for p in parts]
    if any(infos) and not all(infos):
        raise CorruptCacheError(f"{purl}: some parts carry a part manifest (a 'part' field in nbkit.json) and some do not: "
                                "they come from different builds. Remove the parts and rerun the build.")
    length = None
    if infos[0] is not None:
        for p in parts:
            for key in ("cache_generation", "cache_length"):
                if p.info[key] != infos[0][key]:
                    raise CorruptCacheError(f"{purl}/{part_name(p.start, p.stop)}: its {key} differs from the first part's: "
                                            "it belongs to another build of the cache. Remove it, rerun the build, then compose.")
        length = infos[0]["cache_length"]
    gaps, at = [], 0
    for start, stop, name in found:
        if start > at:  # (never below: the parts kept are disjoint)
            gaps.append(f"[{at}, {start})")
        at = stop
    if length is not None and at < length:
        gaps.append(f"[{at}, {length})")
    elif length is not None and at > length:
        raise CorruptCacheError(f"{purl}: a part reaches index {at}, past the cache's length {length}. Remove it, then compose again.")
    if gaps:
        raise ValueError(f"cannot compose {purl[:-len('.parts')]}: no part holds the indices {', '.join(gaps[:5])}"
                         f"{' …' if len(gaps) > 5 else ''} (a column needs every row). Build the missing parts (rerun the "
                         "build: it computes only those), then compose.")
    first = parts[0].meta
    for p in parts[1:]:
        for key in ("schema", "columns", "fingerprint", "allow_pickle"):
            if p.meta.get(key) != first.get(key):
                raise CorruptCacheError(f"{purl}/{part_name(p.start, p.stop)}: its {key} differs from the first part's: it was "
                                        "built from another source or by another plan. Remove it, rerun the build, then compose.")
    return parts


def _read_part(fs, root: str, where: str, start: int, stop: int) -> _Part:
    """:func:`_check_part`; what it finds wrong is a :class:`~nbkit.cluster.part.PartRefused` of ``(start, stop)``,
    which the build driver removes and builds again."""
    try:
        return _check_part(fs, root, where, start, stop)
    except PartRefused:
        raise
    except CorruptCacheError as e:
        raise PartRefused(str(e), bounds=(start, stop)) from e


def check_uploaded(fs, parts: str, bounds: tuple, cache_meta: dict) -> None:
    """Check the uploaded part ``bounds`` under the parts prefix ``parts`` (on ``fs``, no scheme)
    as :func:`compose` will, and against the cache it is built for (``cache_meta``: generation,
    length, schema, columns, fingerprint): its metadata, listing and index, not its sample bytes
    (those are read once, by workers, after compose).

    Raises:
        PartRefused: naming the part; the build removes it and builds it again.

    Example:
        >>> fs, root = connect("gs://bucket/caches/mnist.parts", opts)  # doctest: +SKIP
        >>> check_uploaded(fs, root, (0, 4096), ds.store.meta)  # doctest: +SKIP
    """
    start, stop = bounds
    name = part_name(start, stop)
    part = _read_part(fs, f"{parts}/{name}", f"{parts}/{name}", start, stop)
    wrong = []
    if part.info is None:
        wrong.append("it carries no part manifest")
    elif (part.info["cache_generation"], part.info["cache_length"]) != (cache_meta.get("generation"), cache_meta.get("length")):
        wrong.append(f"it was built for the cache generation {part.info['cache_generation']} of {part.info['cache_length']} "
                     f"samples, and the cache is {cache_meta.get('generation')} of {cache_meta.get('length')}")
    wrong += [f"its {key} differs from the cache's" for key in ("schema", "columns", "fingerprint", "allow_pickle")
              if part.meta.get(key) != cache_meta.get(key)]
    if wrong:
        raise PartRefused(f"the uploaded part {parts}/{name} is refused: {'; '.join(wrong)}. It is removed and built again.",
                          bounds=bounds)


def remove_part(fs, parts: str, bounds: tuple) -> None:
    """Delete the uploaded part ``bounds`` under the parts prefix ``parts`` (on ``fs``)."""
    _remove(fs, f"{parts}/{part_name(*bounds)}")


def _check_part(fs, root: str, where: str, start: int, stop: int) -> _Part:
    """One part, checked: its ``nbkit.json`` (with its part manifest, the ``part`` field that
    :mod:`nbkit.cluster.part` writes, or else a pushed ``manifest.json``), its objects against that
    manifest, ``index.bin`` against its sha256, its metadata against its range, and every record:
    stored, its heap bytes inside the part's heap. Raises ``CorruptCacheError`` (:func:`_read_part`
    makes it a :class:`~nbkit.cluster.part.PartRefused` naming the part)."""
    fix = "Remove that part and rerun the build (it recomputes it), then compose again."
    try:
        raw = read_bounded(fs, f"{root}/{fmt.META}")
    except FileNotFoundError:
        raise CorruptCacheError(f"{where} is not a whole part (it has no {fmt.META}, which a part build writes last): "
                                f"its build was cut short. {fix}") from None
    meta = fmt.parse_meta(raw, f"{where}/{fmt.META}", fix)
    info = meta.get("part")
    if info is not None:
        info = trust.check_json(info, PART_SPEC, f"{where}/{fmt.META} (its 'part' field)", fix)
        unhashed = sorted(n for n, e in info["files"].items() if "sha256" not in e)
        if unhashed:
            raise CorruptCacheError(f"{where}/{fmt.META} records no sha256 for {', '.join(unhashed)}: a part uploaded for "
                                    f"compose carries the hash of every file. {fix}")
        if (info["start"], info["stop"]) != (start, stop) or stop > info["cache_length"]:
            raise CorruptCacheError(f"{where}/{fmt.META} says it holds [{info['start']}, {info['stop']}) of "
                                    f"{info['cache_length']} samples, not its name's [{start}, {stop}). {fix}")
        if meta["generation"] != part_generation(info["cache_generation"], start, stop):  # the CRCs prove bytes, not indices
            raise CorruptCacheError(f"{where}/{fmt.META}: its generation is not the one derived from [{start}, {stop}): it "
                                    f"was built for another range and renamed. {fix}")
        files = dict(info["files"], **{fmt.META: {"size": len(raw), "sha256": hashlib.sha256(raw).hexdigest()}})
        manifest = new_manifest(files, stop - start, stop - start)
    else:
        manifest = read_remote_manifest(fs, root, where)
        if manifest is None or fmt.META not in manifest["files"] or fmt.INDEX not in manifest["files"]:
            raise CorruptCacheError(f"{where} is not a whole part (its {fmt.META} has no 'part' field, and there is no "
                                    f"{MANIFEST} listing {fmt.META} and {fmt.INDEX}): its build was cut short. {fix}")
        files = manifest["files"]
        check_entry(where, fmt.META, files[fmt.META], hashlib.sha256(raw).hexdigest(), len(raw))
    check_listing(fs, root, where, manifest)
    check_file_set(meta, files, where, fix)
    check_meta_sizes(meta, {n: e["size"] for n, e in files.items()}, where, fix)
    if meta["length"] != stop - start or meta.get("capacity") is not None:
        raise CorruptCacheError(f"{where}/{fmt.META} describes {meta['length']} samples"
                                f"{' under a byte budget' if meta.get('capacity') is not None else ''}; the part "
                                f"[{start}, {stop}) holds {stop - start}, all of them. {fix}")
    size = files[fmt.INDEX]["size"]
    raw = read_bounded(fs, f"{root}/{fmt.INDEX}", limit=size)
    check_entry(where, fmt.INDEX, files[fmt.INDEX], hashlib.sha256(raw).hexdigest(), len(raw))
    records = np.frombuffer(raw, fmt.RECORD)
    missing = np.flatnonzero(records["state"] != 1)
    if missing.size:
        raise CorruptCacheError(f"{where} does not store {missing.size} of its samples (first: index "
                                f"{start + int(missing[0])}): a part must hold every sample of its range. {fix}")
    heap = files.get(fmt.HEAP, {"size": 0})["size"]
    in_heap = (records["flags"] & (fmt.FLAG_VAR | fmt.FLAG_FREEFORM)) != 0
    off, n = records["off"][in_heap], records["len"][in_heap]
    if in_heap.any() and (np.any(off > heap) or np.any(n > heap - off)):
        raise CorruptCacheError(f"{where}/{fmt.INDEX} points outside its {heap}-byte heap. {fix}")
    return _Part(start, stop, root, meta, manifest, records, info)


def _compose_tree(fs, dest: str, sources: list, scratch: str) -> int:
    """``dest`` = the concatenation of ``sources`` by server-side compose, at most :data:`MAX_SOURCES`
    a request: groups are composed into intermediates under ``scratch`` first. Returns the requests made."""
    level, requests = 0, 0
    while len(sources) > MAX_SOURCES:
        merged = []
        for i in range(0, len(sources), MAX_SOURCES):
            group = sources[i:i + MAX_SOURCES]
            if len(group) == 1:
                merged.append(group[0])
                continue
            target = f"{scratch}/{level}-{i // MAX_SOURCES:06d}"
            fs.merge(target, group)
            requests += 1
            merged.append(target)
        sources, level = merged, level + 1
    fs.merge(dest, sources)  # one source too: a server-side copy
    return requests + 1


def _remove(fs, root: str) -> None:
    try:
        fs.rm(root, recursive=True)
    except FileNotFoundError:
        pass
    fs.invalidate_cache()


def check_composed(url: str, segments: list, storage_options: dict | None = None) -> str:
    """Read the composed object at ``url`` (on a worker) and return its sha256, after checking that
    it is exactly ``segments`` (``(size, sha256, start, stop)`` of each part's file, in order).

    Raises:
        PartRefused: a segment differs from its part (the part changed after it was checked, or two
            copies of it were uploaded at once): its ``bounds`` name the part, which the build removes
            and builds again.
        CorruptCacheError: the composed object is shorter or longer than its parts.
    """
    fs, path = url_to_fs(url, storage_options)
    total = sum(seg[0] for seg in segments)
    whole = hashlib.sha256()
    at = 0
    with fs.open(path, "rb", block_size=READ_BLOCK, cache_type="none") as f:
        for k, (size, sha, start, stop) in enumerate(segments):
            seg = hashlib.sha256()
            left = size
            while left:
                chunk = f.read(min(READ_BLOCK, left))
                if not chunk:
                    raise CorruptCacheError(f"{url} ends at byte {at + size - left}, before its part {k} does "
                                            f"({total} bytes expected). Compose again.")
                seg.update(chunk)
                whole.update(chunk)
                left -= len(chunk)
            if seg.hexdigest() != sha:
                raise PartRefused(f"{url}: bytes {at}..{at + size} differ from the file of its part {part_name(start, stop)} "
                                  f"(sha256 {seg.hexdigest()[:12]}… vs {sha[:12]}…): the part changed after it was checked. "
                                  "Remove that part and rerun the build (it recomputes it), then compose again.",
                                  bounds=(start, stop))
            at += size
        if f.read(1):
            raise CorruptCacheError(f"{url} is longer than its parts ({total} bytes). Compose again.")
    return whole.hexdigest()
