"""apex ``fp16_utils.fp16util``: manual master-parameter management and half-precision model helpers."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


class tofp16(nn.Module):  # noqa: N801  (apex's name)
    """A module whose forward is ``input.half()`` (apex ``tofp16``).

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import tofp16
      >>> tofp16()(torch.ones(2)).dtype
      torch.float16
    """

    def forward(self, input: torch.Tensor) -> torch.Tensor:  # noqa: A002
        return input.half()


def BN_convert_float(module: nn.Module) -> nn.Module:  # noqa: N802  (apex's name)
    """Converts every affine BatchNorm layer of ``module`` back to float32, in place; returns ``module``.

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import BN_convert_float
      >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).half()
      >>> net = BN_convert_float(net)
      >>> net[0].weight.dtype, net[1].weight.dtype
      (torch.float16, torch.float32)
    """
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True:
        module.float()
    for child in module.children():
        BN_convert_float(child)
    return module


def network_to_half(network: nn.Module) -> nn.Sequential:
    """Converts a model to half precision in a BatchNorm-safe way (legacy; prefer `FP16Model`).

    Returns ``nn.Sequential(tofp16(), BN_convert_float(network.half()))``; ``network`` is converted in place.

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import network_to_half
      >>> net = network_to_half(torch.nn.Linear(2, 3))
      >>> net(torch.ones(1, 2)).dtype
      torch.float16
    """
    return nn.Sequential(tofp16(), BN_convert_float(network.half()))


def convert_module(module: nn.Module, dtype: torch.dtype) -> None:
    """Converts a module's own floating parameters, their grads, and floating buffers to ``dtype``.

    Not recursive: child modules keep their dtype (``convert_network`` walks them).

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import convert_module
      >>> net = torch.nn.Sequential(torch.nn.Linear(2, 2))
      >>> convert_module(net[0], torch.half)
      >>> net[0].weight.dtype, net[0].bias.dtype
      (torch.float16, torch.float16)
    """
    for param in module.parameters(recurse=False):
        if param.data.dtype.is_floating_point:
            param.data = param.data.to(dtype=dtype)
        if param._grad is not None and param._grad.data.dtype.is_floating_point:
            param._grad.data = param._grad.data.to(dtype=dtype)
    for buf in module.buffers(recurse=False):
        if buf is not None and buf.data.dtype.is_floating_point:
            buf.data = buf.data.to(dtype=dtype)


def convert_network(network: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Converts a network's parameters and buffers to ``dtype``, leaving affine BatchNorm layers alone.

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import convert_network
      >>> net = convert_network(torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)), torch.half)
      >>> net[0].weight.dtype, net[1].weight.dtype
      (torch.float16, torch.float32)
    """
    for module in network.modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.affine is True:
            continue
        convert_module(module, dtype)
        if isinstance(module, nn.RNNBase):
            module.flatten_parameters()
    return network


class FP16Model(nn.Module):
    """Wraps a network converted to half precision (affine BatchNorm kept float32); casts inputs to half.

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import FP16Model
      >>> FP16Model(torch.nn.Linear(2, 3))(torch.ones(1, 2)).dtype
      torch.float16
    """

    def __init__(self, network: nn.Module) -> None:
        super().__init__()
        self.network = convert_network(network, dtype=torch.half)

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.network(*(t.half() for t in inputs))


def prep_param_lists(model: nn.Module, flat_master: bool = False) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Creates float32 master copies of a model's trainable parameters.

    Args:
      model: The model.
      flat_master: Put all masters in one flat float32 ``nn.Parameter`` (its ``.grad`` is preallocated,
        zero-filled where apex left it uninitialised). Mixed parameter dtypes are accepted: ``torch.cat``
        promotes them (apex required a single dtype).

    Returns:
      ``(model_params, master_params)``: the model's parameters that require grad, and their float32
      masters (a list of one tensor when ``flat_master``).

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import prep_param_lists
      >>> model = torch.nn.Linear(2, 3).half()
      >>> model_params, master_params = prep_param_lists(model)
      >>> [p.dtype for p in master_params], master_params[0].requires_grad
      ([torch.float32, torch.float32], True)
      >>> prep_param_lists(model, flat_master=True)[1][0].shape
      torch.Size([9])
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        flat = nn.Parameter(_flatten_dense_tensors([p.data for p in model_params]).float())
        flat.grad = torch.zeros_like(flat)
        return model_params, [flat]
    master_params = [p.detach().clone().float() for p in model_params]
    for p in master_params:
        p.requires_grad_(True)
    return model_params, master_params


def model_grads_to_master_grads(
    model_params: list[torch.Tensor], master_params: list[torch.Tensor], flat_master: bool = False
) -> None:
    """Copies the model's gradients into the masters' ``.grad`` (no unscaling: the caller divides).

    A model grad of None makes the master grad None (with ``flat_master``, its slice is zero-filled).

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import prep_param_lists, model_grads_to_master_grads
      >>> model = torch.nn.Linear(2, 1, bias=False).half()
      >>> model_params, master_params = prep_param_lists(model)
      >>> model(torch.ones(1, 2, dtype=torch.half)).sum().backward()
      >>> model_grads_to_master_grads(model_params, master_params)
      >>> master_params[0].grad
      tensor([[1., 1.]])
    """
    if flat_master:
        grads = [p.grad.data if p.grad is not None else torch.zeros_like(p) for p in model_params]
        master = master_params[0]
        if master.grad is None:
            master.grad = torch.zeros_like(master)
        master.grad.data.copy_(_flatten_dense_tensors(grads))
        return
    for model, master in zip(model_params, master_params, strict=True):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        master.grad.data.copy_(model.grad.data)


def master_params_to_model_params(
    model_params: list[torch.Tensor], master_params: list[torch.Tensor], flat_master: bool = False
) -> None:
    """Copies the masters' values into the model parameters (rounding to the model's dtype).

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import prep_param_lists, master_params_to_model_params
      >>> model = torch.nn.Linear(1, 1, bias=False).half()
      >>> model_params, master_params = prep_param_lists(model)
      >>> with torch.no_grad():
      ...     _ = master_params[0].fill_(1.0 + 2**-12)  # below half precision at 1.0
      >>> master_params_to_model_params(model_params, master_params)
      >>> model.weight.item()
      1.0
    """
    if flat_master:
        sources: Iterable[torch.Tensor] = _unflatten_dense_tensors(master_params[0].data, model_params)
    else:
        sources = (m.data for m in master_params)
    for model, master in zip(model_params, sources, strict=True):
        model.data.copy_(master)


def clip_grad_norm(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` under apex's name; returns the total norm.

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import clip_grad_norm
      >>> p = torch.zeros(2, requires_grad=True); p.grad = torch.tensor([3.0, 4.0])
      >>> float(clip_grad_norm([p], 1.0)), p.grad.norm().item() <= 1.0
      (5.0, True)
    """
    return nn.utils.clip_grad_norm_(parameters, max_norm, norm_type)


def to_python_float(t: Any) -> float:
    """``t.item()`` when available, else ``t[0]`` (apex helper).

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import to_python_float
      >>> to_python_float(torch.tensor(2.5))
      2.5
    """
    if hasattr(t, "item"):
        return t.item()
    return t[0]
