"""docs/migrating.md, "Coming from Hugging Face datasets": its examples run as written, and what its
table says about each thing to wrap holds.

``datasets`` comes with the ``dev`` extra (pyproject.toml), so ``make test`` and ``make test-newest`` run
these; a venv without it fails here at import rather than skipping.
"""

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import datasets
import nbkit

REPO = Path(__file__).resolve().parents[1]
HEADING = "## Coming from Hugging Face datasets"


def section_blocks() -> list[str]:
    text = (REPO / "docs" / "migrating.md").read_text()
    assert HEADING in text
    section = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^```python\n(.*?)^```", section, re.S | re.M)


def test_the_section_has_its_two_examples():
    blocks = section_blocks()
    assert len(blocks) == 2
    assert "nbkit.CachedDataset(hf.with_transform(" in blocks[0] and "collate_fn=pad" in blocks[1]


@pytest.mark.slow
def test_the_examples_run_as_written(tmp_path):
    main, ragged = section_blocks()
    script = tmp_path / "hf_example.py"
    script.write_text(
        "import sys\n"
        + main
        + "\nassert isinstance(ds, nbkit.CachedDataset) and len(ds) == 1000 and ds.is_complete\n"
          "batch = next(iter(ds.loader(256)))\n"
          "assert tuple(batch['image'].shape) == (256, 1, 28, 28) and batch['image'].dtype == torch.float32\n"
          "assert tuple(batch['label'].shape) == (256,)\n"
          "x, y = next(iter(loader))['image'], hf[3]['label']\n"
          "assert tuple(x.shape) == (256, 1, 28, 28)\n"
          "expected = (torch.tensor(np.asarray(hf[3]['image'], dtype=np.float32)) / 255 - 0.1307) / 0.3081\n"
          "assert torch.equal(ds[3]['image'][0], expected) and int(ds[3]['label']) == y\n"
          "assert 'datasets' in sys.modules\n"
        + ragged
        + "\nb = next(iter(loader))\n"
          "assert b['input_ids'].shape == (2, 5) and b['attention_mask'].sum() == 8\n"
          "print('hf example ok')\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "hf example ok" in done.stdout
    # The cache opens in a process that never imports datasets.
    reopen = ("import sys, nbkit\nds = nbkit.CachedDataset.open('hf-mnist-cache')\n"
              "assert tuple(ds[0]['image'].shape) == (1, 28, 28)\nassert 'datasets' not in sys.modules\nprint('ok')\n")
    done = subprocess.run([sys.executable, "-c", reopen], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]


def _hf(n=40):
    rng = np.random.default_rng(0)
    return datasets.Dataset.from_dict({"image": rng.integers(0, 256, (n, 4, 4), dtype=np.uint8),
                                       "label": rng.integers(0, 10, n)})


def test_a_formatted_dataset_is_cached_as_columns(tmp_path):
    hf = _hf()
    for fmt in ("torch", "numpy"):
        ds = nbkit.CachedDataset(hf.with_format(fmt), tmp_path / fmt)
        ds.warmup()
        batch = next(iter(ds.loader(8, shuffle=False)))
        assert tuple(batch["image"].shape) == (8, 4, 4)
        assert torch.equal(batch["image"], torch.as_tensor(np.asarray(hf["image"][:8])))
        assert batch["image"].dtype == torch.int64  # HF's formats return the uint8 values as int64
        assert len(list((tmp_path / fmt).glob("col-*.bin"))) == 2


def test_an_unformatted_dataset_caches_each_number_of_a_list_as_a_field(tmp_path):
    ds = nbkit.CachedDataset(_hf(), tmp_path / "plain")
    ds.warmup()
    assert isinstance(ds[0]["image"], list)
    assert len(list((tmp_path / "plain").glob("col-*.bin"))) == 4 * 4 + 1  # what the doc warns about


def test_an_iterable_dataset_is_refused(tmp_path):
    with pytest.raises(TypeError, match="map-style"):
        nbkit.CachedDataset(_hf().to_iterable_dataset(), tmp_path / "it")


def test_a_changed_transform_is_seen_through_the_samples_it_changes(tmp_path):
    hf = _hf()
    nbkit.CachedDataset(hf.with_transform(lambda b: {"x": torch.tensor(np.asarray(b["image"])) * 1}), tmp_path / "c")
    with pytest.raises(nbkit.StaleCacheError, match="content of sample"):
        nbkit.CachedDataset(hf.with_transform(lambda b: {"x": torch.tensor(np.asarray(b["image"])) * 2}), tmp_path / "c")


def test_ragged_fields_need_a_collate(tmp_path):
    text = datasets.Dataset.from_dict({"input_ids": [[1, 2, 3], [4, 5], [6]], "label": [0, 1, 0]})
    ds = nbkit.CachedDataset(text.with_format("torch"), tmp_path / "t")
    ds.warmup()
    assert [len(ds[i]["input_ids"]) for i in range(3)] == [3, 2, 1]
    with pytest.raises(RuntimeError):
        next(iter(ds.loader(3)))


def test_import_nbkit_never_imports_datasets():
    code = "import sys, nbkit; nbkit.CachedDataset; print([m for m in ('datasets', 'pyarrow') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
