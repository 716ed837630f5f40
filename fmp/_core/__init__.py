"""Framework-neutral core of fmp: dtype names, the precision rule table (and its data), the loss-scale update
rule with its array-ops adapters, scope keys, and optional-dependency checks. Nothing here imports JAX or torch,
and nothing here imports the rest of fmp; reports and the comparison core live one floor up, in fmp._report."""
