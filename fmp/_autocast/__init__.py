"""Autocast for JAX: a jaxpr-to-jaxpr mixed-precision transform."""

from fmp._autocast._explain._api import explain as explain
from fmp._autocast._explain._plan import plan as plan
from fmp._autocast._transform import autocast_jaxpr as autocast_jaxpr
from fmp._autocast._wrap import autocast as autocast
from fmp._autocast._wrap import bwd_as_written as bwd_as_written
from fmp._autocast._wrap import float8_state as float8_state

__all__ = ["autocast", "autocast_jaxpr", "bwd_as_written", "explain", "float8_state", "plan"]
