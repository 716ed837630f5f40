"""The jaxpr interpreter under autocast: context, casts, provenance walks, weights, rows, and the only room that touches jax._src (_jax_internals). Imports nothing else of fmp._autocast."""
