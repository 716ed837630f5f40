"""torch.amp's scaler messages, verbatim (the facade's tests compare them with torch's own)."""

from __future__ import annotations

MSG_NO_CUDA = "torch.cuda.amp.GradScaler is enabled, but CUDA is not available.  Disabling."
MSG_GROWTH = "The growth factor must be > 1.0."
MSG_BACKOFF = "The backoff factor must be < 1.0."
MSG_SCALE_NONE = (
    "Attempted {} but _scale is None.  "
    "This may indicate your script did not use scaler.scale(loss or outputs) earlier in the iteration."
)
MSG_OUTPUTS = "outputs must be a Tensor or an iterable of Tensors"
# fmp's own: torch would iterate such an array and hand back a lazy map that fails (or scales nothing) later
MSG_FOREIGN_OUTPUTS = (
    "outputs must be a Tensor or an iterable of Tensors, got a {kind}: fmp.torch.GradScaler scales torch "
    "tensors (torch.amp's API). For JAX use fmp.GradScaler (scaler.scale(loss), fmp.value_and_grad); otherwise "
    "convert with torch.as_tensor(x)."
)
MSG_UNSCALE_TWICE = "unscale_() has already been called on this optimizer since the last update()."
MSG_UNSCALE_AFTER_STEP = "unscale_() is being called after step()."
MSG_FP16 = "Attempting to unscale FP16 gradients."
MSG_CLOSURE = "Closure use is not currently supported if GradScaler is enabled."
MSG_STEP_TWICE = "step() has already been called since the last update()."
MSG_NO_INF_CHECKS_OPT = "No inf checks were recorded for this optimizer."
MSG_NO_INF_CHECKS = "No inf checks were recorded prior to update."
MSG_NEW_SCALE = (
    "new_scale should be a float or a 1-element torch.cuda.FloatTensor or torch.FloatTensor with requires_grad=False."
)
MSG_EMPTY_STATE = (
    "The source state dict is empty, possibly because it was saved from a disabled instance of GradScaler."
)
MSG_PICKLE = (
    "A GradScaler instance may only be pickled at the beginning of an iteration, or at the end after scaler.update()."
)
MSG_GRAD_SCALER_KWARG = (
    "GradScaler is going to stop passing itself as a keyword argument to the passed optimizer. In the near "
    "future GradScaler registers `grad_scale: Tensor` and `found_inf: Tensor` to the passed optimizer and let "
    "the optimizer use them directly."
)
# torch.distributed.fsdp.ShardedGradScaler's
MSG_UNSUPPORTED_DEVICE = "Expected supported device, got {}"

# fmp's own
MSG_WHERE_TORCH = (
    "To see where it starts: [n for n, p in model.named_parameters() if p.grad is not None and "
    "not p.grad.isfinite().all()] before scaler.step(optimizer)."
)
