"""The torch facade: ``import fmp.torch as amp`` in place of ``torch.amp`` / ``torch.cuda.amp``.

Importing this module imports torch; ``import fmp`` never does.
"""

import torch as _torch  # noqa: F401  (fail early with a clear ImportError if torch is missing)

__all__: list[str] = []
