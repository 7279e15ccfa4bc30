"""A rank's results pickled with every tensor detached, on the CPU.

    data = cpu_pickle.dumps(value)     # on a rank; pickle.loads(data) in the kernel

Wherever a tensor sits (a list, a dataclass, a module's parameters, any
object's attributes) and whatever its class (a subclass keeps its class and
its attributes; a DTensor its mesh and placements, its local tensor moved),
so that the kernel never opens a CUDA context to load a result.
"""
import functools
import io


def dumps(value) -> bytes:
    out = io.BytesIO()
    _cpu_pickler()(out).dump(value)
    return out.getvalue()


@functools.cache
def _cpu_pickler():
    """A cloudpickle pickler whose ``reducer_override`` moves every tensor."""
    import cloudpickle
    import torch

    class CPUPickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if type(obj) is torch.Tensor:
                return obj.detach().cpu().__reduce_ex__(2)
            if type(obj) is torch.nn.Parameter:
                moved = torch.nn.Parameter(obj.detach().cpu(), obj.requires_grad)
                return moved.__reduce_ex__(2)
            if isinstance(obj, torch.Tensor) and _pickled_as_a_tensor(type(obj)):
                return _subclass_on_cpu(obj)
            return super().reducer_override(obj)
    return CPUPickler


def _pickled_as_a_tensor(cls) -> bool:
    """Whether ``cls`` pickles as torch's tensors do: a class with its own
    ``__reduce_ex__`` or ``__reduce__`` is left to it."""
    import torch
    return (cls.__reduce_ex__ in (torch.Tensor.__reduce_ex__, torch.nn.Parameter.__reduce_ex__)
            and cls.__reduce__ is torch.Tensor.__reduce__)


def _subclass_on_cpu(obj):
    """A tensor subclass's reduction, its class, attributes and requires_grad
    kept. A wrapper subclass (one with ``__tensor_flatten__``, as DTensor) is
    rebuilt from its inner tensors, which the pickler moves in turn; any other
    from its data, detached on the CPU as a plain tensor."""
    import torch
    state = dict(vars(obj))
    if hasattr(obj, "__tensor_flatten__"):
        names, context = obj.__tensor_flatten__()
        inner = {name: getattr(obj, name) for name in names}
        return _unflatten, (type(obj), inner, context, tuple(obj.size()),
                            tuple(obj.stride()), state)
    plain = obj.detach().cpu().as_subclass(torch.Tensor)
    return _as_subclass, (type(obj), plain, obj.requires_grad, state)


def _unflatten(cls, inner, context, size, stride, state):
    tensor = cls.__tensor_unflatten__(inner, context, size, stride)
    vars(tensor).update(state)
    return tensor


def _as_subclass(cls, plain, requires_grad, state):
    tensor = plain.as_subclass(cls).requires_grad_(requires_grad)
    vars(tensor).update(state)
    return tensor
