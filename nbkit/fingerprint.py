"""What identifies a source dataset, so a cache is never served for a different one.

A fingerprint holds the dataset's type, its length, the repr of its transforms (with memory
addresses removed, which change every session) and a content hash of a few probe samples
(first, middle, last). Fetching probe 0 twice also tells whether the source is deterministic:
a random augmentation inside the source would freeze one random draw into the cache.

Example:
    >>> import torch
    >>> from torch.utils.data import TensorDataset
    >>> from nbkit.fingerprint import fingerprint
    >>> fp, probes = fingerprint(TensorDataset(torch.arange(10)), n_probes=3)
    >>> fp["length"], sorted(fp["samples"])
    (10, ['0', '5', '9'])
"""

from __future__ import annotations

import hashlib
import re

from .codec import encode_freeform
from .errors import NondeterministicSourceError

__all__ = ["fingerprint", "differences", "probe_indices"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _clean_repr(obj) -> str:
    return _ADDRESS.sub("", repr(obj))


def describe_transforms(dataset) -> str:
    parts = []
    for name in ("transform", "target_transform", "transforms"):
        if hasattr(dataset, name):
            value = getattr(dataset, name)
            if name == "transforms" and value is not None and type(value).__name__ == "StandardTransform":
                continue  # torchvision's wrapper of transform + target_transform: already described
            parts.append(f"{name}={_clean_repr(value)}")
    return ", ".join(parts)


def probe_indices(length: int, n_probes: int) -> list[int]:
    if length == 0 or n_probes <= 0:
        return []
    candidates = [0, length // 2, length - 1] + [length * k // n_probes for k in range(1, n_probes)]
    out = []
    for i in candidates:
        if i not in out:
            out.append(i)
        if len(out) == n_probes:
            break
    return sorted(out)


def sample_hash(sample, allow_pickle: bool, where: str) -> str:
    # legacy: the bytes hashed before nbkit kept namedtuples and PIL images, so older caches still match
    return hashlib.sha256(encode_freeform(sample, allow_pickle=allow_pickle, where=where, legacy=True)).hexdigest()[:32]


def fingerprint(dataset, *, n_probes: int = 3, allow_pickle: bool = False):
    """``(fingerprint_dict, {index: sample})`` for ``dataset``.

    Raises:
        NondeterministicSourceError: probe 0 differs between two reads.
    """
    length = len(dataset)
    kind = type(dataset)
    fp = {
        "type": f"{kind.__module__}.{kind.__qualname__}",
        "length": length,
        "transform": describe_transforms(dataset),
        "samples": {},
    }
    probes = {}
    for i in probe_indices(length, n_probes):
        sample = dataset[i]
        probes[i] = sample
        fp["samples"][str(i)] = sample_hash(sample, allow_pickle, f"source sample {i}")
    if probes:
        first = min(probes)
        again = sample_hash(dataset[first], allow_pickle, f"source sample {first}")
        if again != fp["samples"][str(first)]:
            raise NondeterministicSourceError(
                f"{fp['type']} returned different data for index {first} when read twice, so caching it would freeze "
                "one random draw forever. Move random augmentation out of the source and pass it as "
                "CachedDataset(source, path, transform=...), which runs after each cached read. If the difference "
                "is harmless, pass fingerprint_samples=0 to skip this check (and content checks on reopen)."
            )
    return fp, probes


def differences(stored: dict, current: dict) -> list[str]:
    """Human-readable differences between two fingerprints (empty when they match)."""
    out = []
    if stored.get("type") != current.get("type"):
        out.append(f"dataset type: cached {stored.get('type')}, source {current.get('type')}")
    if stored.get("length") != current.get("length"):
        out.append(f"length: cached {stored.get('length')}, source {current.get('length')}")
    if stored.get("transform") != current.get("transform"):
        out.append(f"transform: cached {stored.get('transform')!r}, source {current.get('transform')!r}")
    a, b = stored.get("samples", {}), current.get("samples", {})
    changed = sorted((k for k in a.keys() & b.keys() if a[k] != b[k]), key=int)
    if changed:
        out.append(f"content of sample(s) {', '.join(changed)} differs")
    return out
