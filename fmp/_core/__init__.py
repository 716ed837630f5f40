"""Framework-neutral core of fmp: dtype names, the precision rule table and the
loss-scale update rule. Nothing here imports JAX or torch."""
