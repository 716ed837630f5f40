"""Legacy ``torch.cuda`` paths of the facade: ``fmp.torch.cuda.amp``."""

from fmp.torch.cuda import amp as amp

__all__ = ["amp"]
