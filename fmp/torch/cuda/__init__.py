"""Legacy ``torch.cuda`` paths of the facade: ``fmp.torch.cuda.amp``.

Examples:
  >>> import fmp.torch.cuda
  >>> fmp.torch.cuda.amp.__all__
  ['GradScaler', 'autocast', 'custom_bwd', 'custom_fwd']
"""

from fmp.torch.cuda import amp as amp

__all__ = ["amp"]
