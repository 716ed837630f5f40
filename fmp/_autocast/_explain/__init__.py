"""explain and explain(compare=True): forward rows, loops and gradients compared with the program as written, on the engine."""
