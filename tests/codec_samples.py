"""Samples of every leaf kind, for the format fixture in tests/data/codec_v1 (tests/test_codec_format.py).

``tests/data/codec_v1`` was written from these by the nbkit before issue 28 (``make_fixture`` below,
``cd tests && PYTHONPATH=/path/to/that/nbkit python -c 'import codec_samples; codec_samples.make_fixture()'``); the test checks that today's code writes the same bytes and reads
that cache back. Everything here is deterministic.
"""

from __future__ import annotations

import fractions
import json
from collections import namedtuple
from pathlib import Path

import numpy as np
import torch

Pair = namedtuple("Pair", "image label")
FIXTURE = Path(__file__).resolve().parent / "data" / "codec_v1"


def _image(mode: str, w: int, h: int, seed: int):
    from PIL import Image

    img = Image.new(mode, (w, h))
    rng = np.random.default_rng(seed)
    img.putdata([tuple(rng.integers(0, 256, len(mode))) if len(mode) > 1 else int(rng.integers(0, 256))
                 for _ in range(w * h)])
    return img


def _palette(seed: int, w: int = 3, h: int = 2):
    img = _image("L", w, h, seed).convert("P")
    img.putpalette([(seed * 7 + k) % 256 for k in range(768)])
    return img


def conforming(i: int) -> dict:
    """Sample ``i`` of the conforming source: one leaf of every kind, col and var."""
    g = torch.Generator().manual_seed(i)
    return {
        "t32": torch.randn(3, generator=g),
        "tbf16": torch.randn(2, generator=g).to(torch.bfloat16),
        "tc64": torch.randn(2, dtype=torch.complex64, generator=g),
        "tbool": torch.tensor([i % 2 == 0, True]),
        "be": np.arange(4, dtype=">i4").reshape(2, 2) + i,
        "u5": np.array(["ab", "cde"[: 1 + i % 3]], dtype="<U5"),
        "npf": np.float32(i / 3),
        "npi": np.int16(-i),
        "int": 2**40 + i,
        "float": float("nan") if i == 1 else i / 7,
        "bool": i % 3 == 0,
        "complex": complex(i, -i),
        "none": None,
        "str": "é" * i + "\udc80",
        "bytes": bytes(range(i)),
        "L": _image("L", 4, 3, i),
        "RGB": _image("RGB", 2, 2, i),
        "P": _palette(i),
        "sizes": _image("L", 1 + i % 2, 2, i),
        "arr": np.arange(i + 1, dtype="<f8"),
        "tvar": torch.arange(i + 2, dtype=torch.int64),
        "tvarbf": torch.ones(i + 1, dtype=torch.bfloat16),
        "pickled": fractions.Fraction(i, 7),
        "seq": [Pair(torch.zeros(2), i), (i, "x")],
    }


def odd(i: int):
    """Samples that do not fit the schema: stored free-form."""
    return [(torch.ones(i + 1), "odd", None, np.uint8(i), b"x", 1.5, True, 3j, _image("RGBA", 2, 1, i),
             np.zeros(2, dtype="<c8"), fractions.Fraction(1, i + 1)), {"k": [1, 2]}, torch.tensor(7)][i % 3]


class Source:
    """11 samples: odd ones (free-form) at 1, 2 and 3, conforming ones elsewhere (the probes 0, 5, 10)."""

    def __len__(self):
        return 11

    def __getitem__(self, i):
        if not 0 <= i < len(self):
            raise IndexError(i)
        return odd(i - 1) if 1 <= i <= 3 else conforming(i)


def golden() -> dict:
    """Bytes the codec writes for every sample (free-form and split), as hex."""
    from nbkit.codec import encode_freeform, infer_schema

    src = Source()
    schema = infer_schema([src[0], src[5], src[10]], allow_pickle=True)
    out = {"schema": schema.to_json(), "freeform": [], "legacy": [], "split": []}
    for i in range(len(src)):
        out["freeform"].append(encode_freeform(src[i], allow_pickle=True).hex())
        out["legacy"].append(encode_freeform(src[i], allow_pickle=True, legacy=True).hex())
        parts = schema.split(src[i], "sample", True)
        if parts is None:
            out["split"].append(None)
        else:
            cols, blob = parts
            out["split"].append([[schema.stack(k, [c]).tobytes().hex() for k, c in enumerate(cols)], blob.hex()])
    return out


def make_fixture():
    import shutil

    import nbkit

    if FIXTURE.exists():
        shutil.rmtree(FIXTURE)
    FIXTURE.mkdir(parents=True)
    ds = nbkit.CachedDataset(Source(), FIXTURE / "cache", allow_pickle=True, fingerprint_samples=3)
    ds.warmup()
    ds.close()
    (FIXTURE / "golden.json").write_text(json.dumps(golden(), indent=0) + "\n")


