"""``fmp.torch.autocast_mode``: the names of ``torch.amp.autocast_mode``, for code that imports from there.

``from torch.amp.autocast_mode import autocast`` becomes
``from fmp.torch.autocast_mode import autocast``; the names are ``fmp.torch``'s.
torch's ``autocast_decorator``, a helper of its ``autocast.__call__``, has no
counterpart: decorate with an `fmp.torch.autocast` instance instead.

Examples:
  >>> import fmp.torch
  >>> from fmp.torch.autocast_mode import autocast, is_autocast_available
  >>> autocast is fmp.torch.autocast, is_autocast_available("cpu")
  (True, True)
"""

from fmp.torch._autocast import autocast as autocast
from fmp.torch._autocast import is_autocast_available as is_autocast_available
from fmp.torch._custom import custom_bwd as custom_bwd
from fmp.torch._custom import custom_fwd as custom_fwd

__all__ = ["autocast", "custom_bwd", "custom_fwd", "is_autocast_available"]
