"""Per-field transforms: ``transform=nbkit.fields(RandomCrop(24), None)`` runs one callable on each
top-level field of a sample (``None`` leaves a field as it is; dict samples go by key), where
``CachedDataset(transform=...)`` otherwise receives the whole sample. Picklable whenever its
callables are, so it works in DataLoader workers and with ``ds.loader(...)``.

Example:
    >>> import torch, nbkit
    >>> negate_image = nbkit.fields(torch.neg, None)
    >>> negate_image((torch.ones(2), 7))
    (tensor([-1., -1.]), 7)
    >>> nbkit.fields(label=str)({"image": 1, "label": 3})
    {'image': 1, 'label': '3'}
    >>> describe_sample((torch.zeros(3, 32, 32, dtype=torch.uint8), 7))
    'a tuple (Tensor[3, 32, 32] uint8, int)'
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["fields", "FieldTransform", "describe_sample", "apply_transform"]


def fields(*per_field, **per_key) -> "FieldTransform":
    """A transform that runs one callable per top-level field of a sample.

    Args:
        per_field: for tuple and list samples, one callable (or ``None``: unchanged) per field, in order.
        per_key: for dict samples, a callable per key (keys not named stay unchanged); a single dict
            given by position does the same for keys that are not Python names.

    Example:
        >>> import torch, nbkit
        >>> nbkit.fields(None, lambda y: y + 1)((torch.zeros(1), 1))
        (tensor([0.]), 2)
        >>> nbkit.fields({"label.cls": int})({"label.cls": "3"})
        {'label.cls': 3}
    """
    if len(per_field) == 1 and isinstance(per_field[0], dict) and not per_key:
        per_key, per_field = dict(per_field[0]), ()
    if per_field and per_key:
        raise TypeError("nbkit.fields takes callables by position (tuple or list samples) or by key (dict samples), "
                        "not both")
    if not per_field and not per_key:
        raise TypeError("nbkit.fields needs one callable per field, e.g. nbkit.fields(RandomCrop(24), None) for "
                        "(image, label) samples, or nbkit.fields(image=RandomCrop(24)) for dict samples")
    for name, fn in [*enumerate(per_field), *per_key.items()]:
        if fn is not None and not callable(fn):
            raise TypeError(f"nbkit.fields: the transform for field {name!r} must be callable or None, "
                            f"got {type(fn).__name__}")
    return FieldTransform(per_field if per_field else None, per_key if per_key else None)


class FieldTransform:
    """What :func:`fields` returns: ``positional`` callables for tuple/list samples, or ``by_key`` for dicts."""

    def __init__(self, positional: tuple | None, by_key: dict | None):
        self.positional = positional
        self.by_key = by_key

    def __call__(self, sample):
        if self.by_key is not None:
            if not isinstance(sample, dict):
                raise TypeError(f"{self!r} names fields by key, but the sample is {describe_sample(sample)}; give "
                                "one callable per field by position instead: nbkit.fields(f0, f1, ...)")
            absent = [k for k in self.by_key if k not in sample]
            if absent:
                raise TypeError(f"{self!r}: the sample has no field {absent[0]!r}; it is {describe_sample(sample)}")
            out = dict(sample)
            for k, fn in self.by_key.items():
                if fn is not None:
                    out[k] = _run(fn, sample[k], k)
            return out
        if not isinstance(sample, (tuple, list)):
            raise TypeError(f"{self!r} runs one callable per field of a tuple or list sample, but the sample is "
                            f"{describe_sample(sample)}; for a sample that is one value, pass transform=f itself")
        if len(sample) != len(self.positional):
            raise TypeError(f"{self!r} has {len(self.positional)} callables for a sample of {len(sample)} fields, "
                            f"{describe_sample(sample)}: give one per field (None leaves a field unchanged)")
        values = [v if fn is None else _run(fn, v, k) for k, (fn, v) in enumerate(zip(self.positional, sample))]
        if hasattr(sample, "_fields"):  # a namedtuple keeps its type
            return type(sample)._make(values)
        return tuple(values) if isinstance(sample, tuple) else values

    def __repr__(self) -> str:
        if self.by_key is not None:
            if all(isinstance(k, str) and k.isidentifier() for k in self.by_key):
                return f"nbkit.fields({', '.join(f'{k}={fn!r}' for k, fn in self.by_key.items())})"
            return f"nbkit.fields({self.by_key!r})"
        return f"nbkit.fields({', '.join(map(repr, self.positional))})"


def _run(fn, value, name):
    try:
        return fn(value)
    except Exception as e:
        if hasattr(e, "add_note"):
            e.add_note(f"(raised by {fn!r}, the nbkit.fields transform of field {name!r}, on {describe_sample(value)})")
        raise


def describe_sample(sample, depth: int = 2) -> str:
    """The structure of a sample in a few words, for error messages: ``'a tuple (Tensor[3, 32, 32] uint8, int)'``."""
    return ("a " if isinstance(sample, (tuple, list, dict)) else "") + _describe(sample, depth)


def _describe(x, depth: int) -> str:
    if isinstance(x, torch.Tensor):
        return f"Tensor[{', '.join(map(str, x.shape))}] {str(x.dtype).removeprefix('torch.')}"
    if isinstance(x, np.ndarray):
        return f"ndarray[{', '.join(map(str, x.shape))}] {x.dtype}"
    if isinstance(x, (tuple, list, dict)) and depth > 0:
        items = list(x.items()) if isinstance(x, dict) else list(x)
        parts = [f"{k!r}: {_describe(v, depth - 1)}" for k, v in items[:6]] if isinstance(x, dict) else \
                [_describe(v, depth - 1) for v in items[:6]]
        if len(items) > 6:
            parts.append("…")
        base = dict if isinstance(x, dict) else list if isinstance(x, list) else tuple
        name = type(x).__name__ if hasattr(x, "_fields") else base.__name__
        brackets = {dict: "{}", list: "[]", tuple: "()"}[base]
        return f"{name} {brackets[0]}{', '.join(parts)}{brackets[1]}"
    return type(x).__name__


def apply_transform(transform, samples: list, where: str) -> list:
    """``transform`` applied to each sample; a whole-sample transform that fails on a container sample
    (a torchvision transform given the ``(image, label)`` tuple, say) raises an error that says so
    and names the fix, :func:`fields`.

    Example:
        >>> apply_transform(torch.neg, [torch.ones(1)], "x")
        [tensor([-1.])]
    """
    out = []
    for s in samples:
        try:
            out.append(transform(s))
        except (TypeError, AttributeError) as e:
            if isinstance(transform, FieldTransform) or not isinstance(s, (tuple, list, dict)):
                raise
            raise (TypeError if isinstance(e, TypeError) else AttributeError)(
                _whole_sample_hint(transform, s, where, e)) from e
    return out


def _whole_sample_hint(transform, sample, where: str, error: Exception) -> str:
    name = repr(transform)
    name = name if len(name) <= 48 and "<" not in name else "your_transform"
    if isinstance(sample, dict):
        key = next(iter(sample), "image")
        spelling = f"nbkit.fields({key}={name})" if isinstance(key, str) and key.isidentifier() else \
                   f"nbkit.fields({{{key!r}: {name}}})"
    else:
        spelling = f"nbkit.fields({', '.join([name] + ['None'] * (len(sample) - 1))})"
    return (f"nbkit: transform={name} failed on a sample of {where} ({type(error).__name__}: {error}). "
            f"CachedDataset(transform=...) receives the whole sample, here {describe_sample(sample)}, not one field "
            f"of it. To transform one field, pass one callable per field: transform={spelling} (None leaves a field "
            "unchanged); or give the transform to the source dataset (its transform=) if it is deterministic.")
