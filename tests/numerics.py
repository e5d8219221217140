"""Comparisons of fp32 results that may differ only by the order of their sums (another kernel, a packed
row instead of padded ones, ZeRO's reduce-scatter). A fixed elementwise atol is machine-dependent there:
these bounds scale with the tensor and still fail on a real fault, which moves whole rows or most
elements by O(1) relative."""

import torch


def same_up_to_summation_order(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Elementwise within rtol 1e-4 plus a few ulps of the tensor's largest element (an element near zero
    of a gradient whose largest is ~80, the embedding's, moves by ~1e-5 with the summation order, above a
    fixed atol of 1e-6), and within 1e-5 in norm."""
    scale = float(want.abs().max())
    return (torch.allclose(got, want, rtol=1e-4, atol=1e-6 * max(1.0, scale))
            and float((got - want).norm()) <= 1e-5 * float(want.norm()) + 1e-12)


def same_adam_update(got: torch.Tensor, want: torch.Tensor, lr: float) -> bool:
    """Two AdamW runs' weight changes (after minus before) whose gradients differ only by summation order:
    within 1% of the update's norm, and no element off by more than 5% of lr. Adam divides by sqrt(v),
    so an element whose gradient is near zero turns a rounding difference of the gradient into a visible
    one of its update (under ZeRO-3 on one CPU: one element of 3,072 off by 2.7e-5 at lr 1e-2, norms within
    5e-5; one of a 16-element tensor off by 1.3e-5, its norm within ~3e-4: in a small tensor one such
    element is a large share of the norm). A real fault (a micro-batch dropped, a rank's gradients
    missing) changes most elements by O(lr), the norm by O(1) relative."""
    return (float((got - want).norm()) <= 1e-2 * float(want.norm()) + 1e-12
            and float((got - want).abs().max()) <= 0.05 * lr)
