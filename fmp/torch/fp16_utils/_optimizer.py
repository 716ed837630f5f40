"""apex ``FP16_Optimizer``: float32 master weights and loss scaling around any torch optimizer."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from fmp.torch.fp16_utils._fp16util import clip_grad_norm
from fmp.torch.fp16_utils._loss_scaler import AmpLossScaler

_LOW = (torch.float16, torch.bfloat16)

_MSG_OVERFLOW_STEP = "Gradient overflow.  Skipping step, reducing loss scale to {}"
_MSG_OVERFLOW_CLOSURE = "OVERFLOW within closure! Skipping step, reducing loss scale to {}"
_MSG_INSPECT_OVERFLOW = (
    "Warning:  calling FP16_Optimizer.inspect_master_grad_data while in an overflow state.  "
    "Gradients are currently invalid (may be inf, nan, or stale).  Returning None."
)
_MSG_BAD_DTYPE = (
    "Wrapped parameters must be either float32, float16 or bfloat16 tensors. Received {} "
    "(param {} of param group {}). Keep float64 parameters out of the optimizer you wrap."
)


class FP16_Optimizer:  # noqa: N801  (apex's name)
    """Wraps a torch optimizer with float32 master weights and static or dynamic loss scaling (apex API).

    Each float16/bfloat16 parameter that requires grad is replaced in ``init_optimizer.param_groups`` by a
    float32 master copy (its optimizer state is re-keyed and recast); float32 parameters are used as they
    are. `FP16_Optimizer.backward` scales the loss and unscales the gradients into
    the masters, `FP16_Optimizer.step` steps
    the masters and copies them back into the model's half parameters. Runs on CPU and CUDA (no CUDA-only
    call), unlike apex.

    The internal scaler follows ``apex.amp.scaler.LossScaler``, as apex's own ``FP16_Optimizer`` did since
    2019: a static scale never checks for overflow; the dynamic one starts at ``min(init_scale,
    max_loss_scale)`` (2**16), halves on overflow (no floor unless ``min_loss_scale``), doubles after
    ``scale_window`` (2000) clean updates, capped at ``max_loss_scale`` (2**24), and **ignores
    ``scale_factor``** (apex hard-codes 2). The scale changes inside
    `FP16_Optimizer.backward`.

    Differences from apex (deliberate, all tested):

    * overflow is detected element-wise with torch's ``_amp_foreach_non_finite_check_and_unscale_``
      kernel (one pass that checks and unscales, reduced on device, one host sync per step), never by
      summing each gradient; apex's Python fallback flagged finite grads whose sum overflows;
    * a half parameter whose ``.grad`` is None gets a master grad of None (apex kept a stale master grad);
    * several ``backward(loss)`` calls with ``update_master_grads=True`` before ``zero_grad`` give the
      right master grads for float32 params too (apex divided the earlier grads twice), and stay right
      when a dynamic scale changes between the calls;
    * bfloat16 parameters get masters too; other dtypes raise ``TypeError``;
    * ``state_dict()['loss_scaler']`` is a dict of Python scalars (torch's five scaler keys plus
      ``dynamic``, ``min_loss_scale``, ``max_loss_scale``), not a pickled object, so ``torch.load`` with its
      default ``weights_only=True`` reads the checkpoint;
    * `FP16_Optimizer.inspect_master_grad_data` warns
      (``UserWarning``) instead of printing.

    Args:
      init_optimizer: A ``torch.optim.Optimizer`` over the model's parameters (any mix of fp16/bf16/fp32).
      static_loss_scale: Loss scale used when ``dynamic_loss_scale`` is False.
      dynamic_loss_scale: Use dynamic loss scaling (overrides ``static_loss_scale``).
      dynamic_loss_args: Keyword arguments for the dynamic scaler: ``init_scale``, ``scale_factor``
        (ignored), ``scale_window``, ``min_loss_scale``, ``max_loss_scale``.
      verbose: Print the parameters ingested. Overflow messages are printed regardless.

    Raises:
      TypeError: ``init_optimizer`` is not a torch optimizer, a parameter has an unsupported dtype, or
        ``dynamic_loss_args`` has an unknown key.
      ValueError: a loss-scale argument is out of range.

    Examples:
      >>> import torch
      >>> from fmp.torch.fp16_utils import FP16_Optimizer
      >>> model = torch.nn.Linear(2, 1).half()
      >>> optimizer = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1), static_loss_scale=128.0,
      ...                            verbose=False)
      >>> loss = model(torch.ones(1, 2, dtype=torch.half)).float().sum()
      >>> optimizer.backward(loss)
      >>> optimizer.inspect_master_grad_data()[0][0]  # unscaled float32 master grads
      tensor([[1., 1.]])
      >>> optimizer.step()
      >>> optimizer.loss_scale, model.weight.dtype
      (128.0, torch.float16)
    """

    def __init__(
        self,
        init_optimizer: torch.optim.Optimizer,
        static_loss_scale: float = 1.0,
        dynamic_loss_scale: bool = False,
        dynamic_loss_args: dict[str, Any] | None = None,
        verbose: bool = True,
    ) -> None:
        if not isinstance(init_optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"init_optimizer must be a torch.optim.Optimizer, got {type(init_optimizer).__name__}. "
                "Build the optimizer over model.parameters() first, then wrap it."
            )
        self.verbose = verbose
        self.optimizer = init_optimizer
        self.fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp16_groups: list[list[torch.Tensor]] = []
        self.fp32_from_fp32_groups: list[list[torch.Tensor]] = []
        for gi, group in enumerate(self.optimizer.param_groups):
            self.maybe_print(f"FP16_Optimizer processing param group {gi}:")
            half, masters, full = [], [], []
            for pi, param in enumerate(group["params"]):
                if not param.requires_grad:
                    continue
                if param.dtype in _LOW:
                    self.maybe_print(f"FP16_Optimizer received {param.type()} with {param.size()}")
                    master = param.detach().clone().float().requires_grad_(True)
                    group["params"][pi] = master
                    if param in self.optimizer.state:
                        self.optimizer.state[master] = self.optimizer.state.pop(param)
                    half.append(param)
                    masters.append(master)
                elif param.dtype == torch.float32:
                    self.maybe_print(f"FP16_Optimizer received {param.type()} with {param.size()}")
                    full.append(param)
                else:
                    raise TypeError(_MSG_BAD_DTYPE.format(param.dtype, pi, gi))
            self.fp16_groups.append(half)
            self.fp32_from_fp16_groups.append(masters)
            self.fp32_from_fp32_groups.append(full)
        self.all_fp16_params = [p for g in self.fp16_groups for p in g]
        self.all_fp32_from_fp16_params = [p for g in self.fp32_from_fp16_groups for p in g]
        self.all_fp32_from_fp32_params = [p for g in self.fp32_from_fp32_groups for p in g]
        # Recast any pre-existing per-param state (e.g. momentum) to the masters' dtype.
        self.optimizer.load_state_dict(self.optimizer.state_dict())

        if dynamic_loss_scale:
            self.dynamic_loss_scale = True
            args = dict(dynamic_loss_args or {})
            allowed = {"init_scale", "scale_factor", "scale_window", "min_loss_scale", "max_loss_scale"}
            unknown = sorted(set(args) - allowed)
            if unknown:
                raise TypeError(f"dynamic_loss_args has unknown keys {unknown}; expected a subset of {sorted(allowed)}")
            self.loss_scaler = AmpLossScaler("dynamic", **args)
        else:
            self.dynamic_loss_scale = False
            self.loss_scaler = AmpLossScaler(static_loss_scale)
        self.overflow = False
        self.first_closure_call_this_step = True
        self.clip_grad_norm = clip_grad_norm
        self._unscaled_by: float | None = None  # the scale the last update_master_grads divided by

    def maybe_print(self, msg: str) -> None:
        """Prints ``msg`` if ``verbose``."""
        if self.verbose:
            print(msg)

    def __getstate__(self) -> Any:
        raise RuntimeError("FP16_Optimizer should be serialized using state_dict().")

    def __setstate__(self, state: Any) -> None:
        raise RuntimeError("FP16_Optimizer should be deserialized using load_state_dict().")

    def zero_grad(self, set_grads_to_None: bool = False) -> None:  # noqa: N803  (apex's name)
        """Zeros (or sets to None) the grads of the masters, the float32 params and the half model params."""
        self._unscaled_by = None
        for p in [p for g in self.optimizer.param_groups for p in g["params"]] + self.all_fp16_params:
            if set_grads_to_None:
                p.grad = None
            elif p.grad is not None:
                p.grad.detach_()
                p.grad.zero_()

    def _master_params_to_model_params(self) -> None:
        if self.all_fp16_params:
            with torch.no_grad():
                torch._foreach_copy_(self.all_fp16_params, self.all_fp32_from_fp16_params)

    def clip_master_grads(self, max_norm: float, norm_type: float = 2) -> torch.Tensor | int:
        """Clips the float32 master gradients with ``torch.nn.utils.clip_grad_norm_``.

        Args:
          max_norm: Max norm of the gradients.
          norm_type: Type of the p-norm (``float('inf')`` for the infinity norm).

        Returns:
          The total norm of the master gradients (viewed as one vector), or ``-1`` if the most recent
          gradients overflowed (``self.overflow``).
        """
        if self.overflow:
            return -1
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        return self.clip_grad_norm(params, max_norm, norm_type)

    def state_dict(self) -> dict[str, Any]:
        """This wrapper's state and the wrapped optimizer's ``state_dict()``, for ``torch.save``.

        Keys: ``loss_scaler`` (a dict of Python scalars), ``dynamic_loss_scale``, ``overflow``,
        ``first_closure_call_this_step``, ``optimizer_state_dict``, ``fp32_from_fp16`` (the float32
        masters per param group, sharing storage with the live ones, like torch's optimizer state).
        """
        return {
            "loss_scaler": self.loss_scaler.state_dict(),
            "dynamic_loss_scale": self.dynamic_loss_scale,
            "overflow": self.overflow,
            "first_closure_call_this_step": self.first_closure_call_this_step,
            "optimizer_state_dict": self.optimizer.state_dict(),
            "fp32_from_fp16": [[m.detach() for m in g] for g in self.fp32_from_fp16_groups],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a `FP16_Optimizer.state_dict`; call ``model.load_state_dict`` too (before or after).

        The saved float32 masters are copied into the current ones, so no precision is lost on resume.

        Raises:
          TypeError: ``state_dict`` is not a dict or its ``loss_scaler`` entry is not a dict.
        """
        if not isinstance(state_dict, dict):
            raise TypeError(f"state_dict must be a dict from FP16_Optimizer.state_dict(), got {type(state_dict)}")
        scaler_state = state_dict["loss_scaler"]
        if not isinstance(scaler_state, dict):
            raise TypeError(
                "state_dict['loss_scaler'] must be the dict fmp's FP16_Optimizer.state_dict() writes, got "
                f"{type(scaler_state).__name__} (a pickled apex scaler object is not supported)"
            )
        self.loss_scaler.load_state_dict(scaler_state)
        self.dynamic_loss_scale = state_dict["dynamic_loss_scale"]
        self.overflow = state_dict["overflow"]
        self.first_closure_call_this_step = state_dict["first_closure_call_this_step"]
        self.optimizer.load_state_dict(state_dict["optimizer_state_dict"])
        with torch.no_grad():
            for current_group, saved_group in zip(
                self.fp32_from_fp16_groups, state_dict["fp32_from_fp16"], strict=True
            ):
                for current, saved in zip(current_group, saved_group, strict=True):
                    current.copy_(saved)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Steps the float32 masters and copies them into the model; skips the step after an overflow.

        Args:
          closure: Optional closure for the wrapped optimizer. It must call this object's ``zero_grad()``,
            compute the loss, call ``backward(loss)`` and return the loss. With dynamic scaling, a closure
            whose gradients overflow is called again at the reduced scale until they do not.

        Returns:
          The wrapped optimizer's return value, or None if the step was skipped.
        """
        if self.overflow:
            print(_MSG_OVERFLOW_STEP.format(self.loss_scaler.loss_scale()))
            return None
        if closure is not None:
            retval = self._step_with_closure(closure)
        else:
            retval = self.optimizer.step()
        self._master_params_to_model_params()
        return retval

    def _step_with_closure(self, closure: Callable[[], Any]) -> Any:
        def wrapped_closure() -> Any:
            if self.first_closure_call_this_step:
                self.first_closure_call_this_step = False
            else:
                # The wrapped optimizer may have moved the masters since the last call (LBFGS does).
                self._master_params_to_model_params()
            loss = closure()
            while self.overflow:
                print(_MSG_OVERFLOW_CLOSURE.format(self.loss_scaler.loss_scale()))
                loss = closure()
            return loss

        retval = self.optimizer.step(wrapped_closure)
        self.first_closure_call_this_step = True
        return retval

    def backward(self, loss: torch.Tensor, update_master_grads: bool = True, retain_graph: bool = False) -> None:
        """Backpropagates ``loss.float() * loss_scale`` and (by default) fills the float32 master grads.

        Args:
          loss: The loss (float or half; it is converted to float32 before scaling).
          update_master_grads: Copy and unscale the model grads into the master grads now. Pass False
            for every loss but the last when several losses are backpropagated into one step, then call
            `FP16_Optimizer.update_master_grads` once (each call also
            advances the dynamic scale schedule).
          retain_graph: Forwarded to ``Tensor.backward``.
        """
        self._rescale_unscaled_grads()
        scaled_loss = loss.float() * self.loss_scaler.loss_scale()
        scaled_loss.backward(retain_graph=retain_graph)
        if update_master_grads:
            self.update_master_grads()

    def update_master_grads(self) -> None:
        """Copies the half model grads into the float32 master grads and unscales all of them.

        Float32 parameters are unscaled in place. With dynamic scaling this also checks every element for
        inf/NaN, sets ``self.overflow`` and updates the scale.
        """
        self._rescale_unscaled_grads()
        self.loss_scaler.clear_overflow_state()
        grads: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for model, master in zip(self.all_fp16_params, self.all_fp32_from_fp16_params, strict=True):
            if model.grad is None:
                master.grad = None
                continue
            if master.grad is None:
                master.grad = torch.empty_like(master)
            grads.append(master.grad)
            sources.append(model.grad)
        if grads:
            with torch.no_grad():
                torch._foreach_copy_(grads, sources)
        grads.extend(p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None)
        self._unscaled_by = self.loss_scaler.loss_scale()
        self.loss_scaler.unscale(grads)
        self.overflow = self.loss_scaler.update_scale()

    def _rescale_unscaled_grads(self) -> None:
        """Brings grads left by an earlier `FP16_Optimizer.update_master_grads` back to the current loss scale.

        Another backward pass before ``zero_grad`` adds scaled grads to them: float32 params were unscaled
        in place, and half model grads carry the scale of that time, which a dynamic update may have
        changed since. apex mixed the two (its docs call the two-call pattern valid; for float32 params it
        was not); here both are rescaled first, exactly for power-of-two scales.
        """
        if self._unscaled_by is None:
            return
        old, new = self._unscaled_by, self.loss_scaler.loss_scale()
        self._unscaled_by = None
        with torch.no_grad():
            full = [p.grad for p in self.all_fp32_from_fp32_params if p.grad is not None]
            if full and new != 1.0:
                torch._foreach_mul_(full, new)
            half = [p.grad for p in self.all_fp16_params if p.grad is not None]
            if half and new != old:
                torch._foreach_mul_(half, new / old)

    def inspect_master_grad_data(self) -> list[list[torch.Tensor | None]] | None:
        """The float32 master gradients, one list per param group (None after an overflow, with a warning)."""
        if self.overflow:
            warnings.warn(_MSG_INSPECT_OVERFLOW, UserWarning, stacklevel=2)
            return None
        return [
            [p.grad.data if p.grad is not None else None for p in group["params"]]
            for group in self.optimizer.param_groups
        ]

    @property
    def loss_scale(self) -> float:
        """The current loss scale; assignable (for a dynamic scale, the schedule continues from it)."""
        return self.loss_scaler.loss_scale()

    @loss_scale.setter
    def loss_scale(self, value: float) -> None:
        self.loss_scaler._loss_scale = float(value)

    @property
    def state(self) -> Any:
        """The wrapped optimizer's ``state``."""
        return self.optimizer.state

    @state.setter
    def state(self, value: Any) -> None:
        self.optimizer.state = value

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's ``param_groups`` (holding the masters), e.g. to change the learning rate."""
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value
