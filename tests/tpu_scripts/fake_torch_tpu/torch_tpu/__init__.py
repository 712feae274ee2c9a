"""A stand-in for TorchTPU (``torch_tpu``, torch_xla's successor) for a machine without TPU chips, where
the real package registers no device: it registers a native ``"tpu"`` device the way an out-of-tree backend does (torch's PrivateUse1 key,
renamed), whose tensors keep their data in CPU tensors. Enough to run nbkit's seam (batches moved
with ``tensor.to("tpu")``, ops on them, ``.cpu()``), nothing about real TPU behaviour.

It needs torch's Python backend hooks
(``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, torch >= 2.10);
on an older torch importing it raises ImportError."""

import torch
from torch.utils._pytree import tree_map

try:
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
except ImportError as e:
    raise ImportError(f"the fake torch_tpu needs torch's Python backend hooks (torch >= 2.10), not torch {torch.__version__}") from e

__version__ = "0.0.0+fake"
FAKE = True
DEVICE = "tpu"  # the real package's name for it (tests/tpu/test_torch_tpu_real.py checks that they agree)

_setup_privateuseone_for_python_backend(DEVICE)


class FakeTPUTensor(torch.Tensor):
    """Says it lives on ``tpu:0``; its data is the CPU tensor ``elem``."""

    @staticmethod
    def __new__(cls, elem):
        r = torch.Tensor._make_wrapper_subclass(cls, elem.shape, dtype=elem.dtype, device=torch.device("tpu", 0),
                                                strides=elem.stride(), requires_grad=elem.requires_grad)
        r.elem = elem
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.copy_.default:
            dst, src = args[0], args[1]
            dst.elem.copy_(src.elem if isinstance(src, FakeTPUTensor) else src)
            return dst
        device = kwargs.get("device")
        if func is torch.ops.aten._to_copy.default and device is not None and torch.device(device).type == "cpu":
            return args[0].elem.to(dtype=kwargs.get("dtype") or args[0].dtype, copy=True)
        kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
        def unwrap(t):
            return t.elem if isinstance(t, FakeTPUTensor) else t

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        return tree_map(lambda t: FakeTPUTensor(t) if type(t) is torch.Tensor else t, out)


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    return FakeTPUTensor(torch.empty(size, dtype=dtype))


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    return FakeTPUTensor(torch.empty_strided(size, stride, dtype=dtype))


_lib = torch.library.Library("aten", "IMPL")
_lib.impl("empty.memory_format", _empty, "PrivateUse1")
_lib.impl("empty_strided", _empty_strided, "PrivateUse1")
