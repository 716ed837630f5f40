"""The torch FX transform: trace, rewrite, casts, nested regions, policy, float8 and scaled_mm, explain and compare."""
