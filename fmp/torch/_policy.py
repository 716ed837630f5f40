"""fmp policies as the torch facade reads them: the eager ``autocast`` and the FX passes alike."""

from __future__ import annotations

from fmp._policy import Policy, get_policy

_MSG_FLOAT8 = (
    "policy {got!r} asks for float8 matmuls (float8={float8}), which {where} does not run: it would quietly "
    "compute in {compute} instead. Use fmp.torch.autocast_fx(model, inputs, {got!r}) (tensorwise and rowwise "
    "recipes), a policy without float8 here (e.g. 'mixed_bfloat16'), or float8 on the JAX side "
    "(fmp.autocast(fn, 'mixed_float8'))."
)


def torch_policy(policy: Policy | str, where: str = "fmp.torch.autocast (eager)", float8: bool = False) -> Policy:
    """``get_policy(policy)``; a policy with a float8 recipe only where ``float8`` says the caller runs one
    (the FX pass checks the recipe itself).

    Raises:
      NotImplementedError: the policy carries a float8 recipe and ``where`` runs none.
    """
    pol = get_policy(policy)
    if pol.float8 is not None and not float8:
        raise NotImplementedError(
            _MSG_FLOAT8.format(got=str(policy), float8=pol.float8, compute=pol.compute_dtype.name, where=where)
        )
    return pol
