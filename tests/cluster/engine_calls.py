"""Calls the engine tests send to workers: module-level, so every worker process can import them."""

import os
import time


def square(x):
    return x * x


def pid():
    return os.getpid()


def hold_once(folder, seconds):
    """The first call writes its pid into ``folder`` and sleeps (the test kills it); a retry returns at once."""
    first = not os.listdir(folder)
    with open(os.path.join(folder, str(os.getpid())), "w"):
        pass
    if first:
        time.sleep(seconds)
    return "done", os.getpid()


def sleep(seconds):
    time.sleep(seconds)
    return seconds


def make_part(source, start, stop, folder, fingerprint):
    """A part as a build writes it: a small nbkit cache of ``source[start:stop]``, carrying the whole
    source's ``fingerprint``. Returns its directory."""
    import json

    import torch

    import nbkit
    from nbkit import format as fmt

    ds = nbkit.CachedDataset(torch.utils.data.Subset(source, range(start, stop)), folder)
    ds.warmup()
    root = ds.root
    ds.close()
    path = os.path.join(root, fmt.META)
    with open(path) as f:
        meta = json.load(f)
    meta["fingerprint"] = fingerprint
    with open(path, "w") as f:
        json.dump(meta, f)
    return root


def build_and_push_part(source, start, stop, url, storage_options, fingerprint):
    """On a worker: build the part ``[start, stop)`` in a scratch directory and push it beside ``url``."""
    import shutil
    import tempfile

    import nbkit
    from nbkit.cluster.compose import parts_url
    from nbkit.cluster.part import part_name

    folder = tempfile.mkdtemp(prefix="nbkit-part-")
    try:
        root = make_part(source, start, stop, os.path.join(folder, "part"), fingerprint)
        nbkit.push(root, f"{parts_url(url)}/{part_name(start, stop)}", storage_options=storage_options)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return start, stop, os.getpid()
