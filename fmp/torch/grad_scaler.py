"""``fmp.torch.grad_scaler``: the names of ``torch.amp.grad_scaler``, for code that imports from there.

``from torch.amp.grad_scaler import GradScaler`` becomes
``from fmp.torch.grad_scaler import GradScaler`` (`fmp.torch.GradScaler`).
``OptState``, the per-optimizer stage (``READY``, ``UNSCALED``, ``STEPPED``), is
torch's own enum, which fmp's scaler records.

Examples:
  >>> import fmp.torch
  >>> from fmp.torch.grad_scaler import GradScaler, OptState
  >>> GradScaler is fmp.torch.GradScaler, [s.name for s in OptState]
  (True, ['READY', 'UNSCALED', 'STEPPED'])
"""

from torch.amp.grad_scaler import OptState as OptState

from fmp.torch._scaler._grad_scaler import GradScaler as GradScaler

__all__ = ["GradScaler", "OptState"]
