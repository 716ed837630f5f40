"""explain_fx and explain_graph: the rows of the FX rewrite and, with compare=True, each op against the graph as
written (forward and gradients), on the rewrite side of fmp.torch._fx, which never imports this room."""
