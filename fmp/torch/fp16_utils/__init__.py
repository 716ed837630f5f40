"""apex ``fp16_utils`` on fmp: ``FP16_Optimizer``, the loss scalers and the master-parameter helpers.

A drop-in for the removed ``apex.fp16_utils`` (``from fmp.torch import fp16_utils``) that runs on CPU and
CUDA. Overflow is detected element-wise with torch's own kernel; see
`FP16_Optimizer` for the documented differences from apex.
"""

from fmp.torch.fp16_utils._fp16util import BN_convert_float as BN_convert_float
from fmp.torch.fp16_utils._fp16util import FP16Model as FP16Model
from fmp.torch.fp16_utils._fp16util import clip_grad_norm as clip_grad_norm
from fmp.torch.fp16_utils._fp16util import convert_module as convert_module
from fmp.torch.fp16_utils._fp16util import convert_network as convert_network
from fmp.torch.fp16_utils._fp16util import master_params_to_model_params as master_params_to_model_params
from fmp.torch.fp16_utils._fp16util import model_grads_to_master_grads as model_grads_to_master_grads
from fmp.torch.fp16_utils._fp16util import network_to_half as network_to_half
from fmp.torch.fp16_utils._fp16util import prep_param_lists as prep_param_lists
from fmp.torch.fp16_utils._fp16util import to_python_float as to_python_float
from fmp.torch.fp16_utils._fp16util import tofp16 as tofp16
from fmp.torch.fp16_utils._loss_scaler import DynamicLossScaler as DynamicLossScaler
from fmp.torch.fp16_utils._loss_scaler import LossScaler as LossScaler
from fmp.torch.fp16_utils._optimizer import FP16_Optimizer as FP16_Optimizer

__all__ = [
    "BN_convert_float",
    "DynamicLossScaler",
    "FP16Model",
    "FP16_Optimizer",
    "LossScaler",
    "clip_grad_norm",
    "convert_module",
    "convert_network",
    "master_params_to_model_params",
    "model_grads_to_master_grads",
    "network_to_half",
    "prep_param_lists",
    "to_python_float",
    "tofp16",
]
