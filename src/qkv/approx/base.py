"""The base of the approximate mechanisms: the checks that open every forward call, written once.

Shape legend: ``b`` batch, ``h`` query heads, ``g`` KV heads, ``i`` query length, ``j`` key
length, ``d`` query/key size, ``e`` value size.

Every mechanism in :mod:`qkv.approx` opens its forward the same way, in this order (the
order decides which error a call with several faults gets, so it is fixed here):

1. ``q, k, v`` and the ``causal`` / ``return_weights`` flags are checked
   (the tensors: type, dtype, rank, device and matching sizes; then that both flags are bools);
2. ``causal=True`` is refused by a method that mixes all positions;
3. the method's own sizes are checked (:meth:`ApproxAttention.check_sizes`);
4. the mask is made dense and reduced to what the
   method honours (:meth:`ApproxAttention.honoured_mask`): by default a key padding mask,
   ``keep (b|1, h|1, j)``.

A subclass declares its name in errors (``method``), why it cannot be causal
(``why_not_causal``, None when it can) and what runs a mask it cannot honour
(``mask_hint``), then calls ``dims, keep = self.check_call(...)``, answers an empty call with
:meth:`ApproxAttention.empty_result`, and zeroes the keys and values no query sees with
:func:`unseen_zeroed` (a padded slot holding nan or inf, as a cache from ``torch.empty`` may,
would reach every output through its weight of 0: ``0 · nan = nan``).
"""

from __future__ import annotations

from torch import Tensor, nn

from ._common import Dims, check_flags, check_qkv, dense_mask, key_padding

#: ``mask_hint`` of a method that can be causal: the causal mask has a flag of its own.
CAUSAL_INSTEAD = "use causal=True for the causal mask, or exact attention (qkv.attention) for other masks"


class ApproxAttention(nn.Module):
    """Base of the :mod:`qkv.approx` mechanisms: :meth:`check_call` validates a forward call.

    Class attributes a subclass sets:
        method: its name in errors, e.g. ``"Linformer"``.
        why_not_causal: the clause ``causal=True`` is refused with (``"<why>, so it cannot be
            causal; ..."``), or None when the method can be causal.
        mask_hint: what to use instead of a mask that is not key padding, the end of
            the key padding check's error (:data:`CAUSAL_INSTEAD` for a
            method that can be causal). Not read by a subclass that overrides
            :meth:`honoured_mask`.
    """

    method: str
    why_not_causal: str | None = None
    mask_hint: str

    def check_call(
        self, q: Tensor, k: Tensor, v: Tensor, *, mask: object, causal: object, return_weights: object
    ) -> tuple[Dims, Tensor | None]:
        """Validate one forward call; return its sizes and the mask the method honours.

        The mask is ``keep (b|1, h|1, j)`` (True = real key) unless :meth:`honoured_mask` is
        overridden, and None without a mask. Errors name the argument (``ValueError`` /
        ``TypeError``), in the order of the module docstring.
        """
        dims = check_qkv(q, k, v)
        check_flags(causal, return_weights)
        if causal and self.why_not_causal is not None:
            raise ValueError(
                f"causal: {self.why_not_causal}, so it cannot be causal; "
                "use qkv.approx.Performer or qkv.approx.LinearAttention with causal=True, or exact attention"
            )
        self.check_sizes(dims, k)
        return dims, self.honoured_mask(dense_mask(mask, dims, q.device), dims)

    def empty_result(self, q: Tensor, k: Tensor, v: Tensor, dims: Dims, return_weights: bool):
        """Exact attention's answer to a call with no batch row, query or key (``out = 0 (b, h, i, e)``, weights
        ``0 (b, h, i, j)``: a row without keys attends to nothing), or None for a call with all three. The
        methods' block and landmark arithmetic divides by these sizes."""
        if min(dims.b, dims.i, dims.j) > 0:
            return None
        tie = (q.sum() + k.sum() + v.sum()) * 0  # (connects the result to the inputs' graph: their gradients are 0)
        out = q.new_zeros(dims.b, dims.h, dims.i, dims.e) + tie
        return (out, q.new_zeros(dims.b, dims.h, dims.i, dims.j) + tie) if return_weights else out

    def check_sizes(self, dims: Dims, k: Tensor) -> None:
        """Sizes the method's own settings fix (``d``, ``j``, ``h``); raise ``ValueError`` when
        they do not fit. ``k`` is passed for its shape in messages. Nothing by default."""

    def honoured_mask(self, mask: Tensor | None, dims: Dims) -> Tensor | None:
        """The dense mask ``(b|1, h|1, i|1, j)`` reduced to what the method can run: by default
        a key padding ``keep (b|1, h|1, j)``, refusing masks that vary with the query."""
        return key_padding(mask, dims, self.method, self.mask_hint)


def unseen_zeroed(x: Tensor, seen: Tensor | None) -> Tensor:
    """``x (b, g, j, c)`` (keys or values) with the rows no query sees set to 0; ``seen (b|1, h|1, j)``.

    With ``h`` query heads over ``g`` KV heads, a row is zeroed where no head of its group sees
    it (a row one head sees and another does not is left: the seeing head needs it).
    """
    if seen is None:
        return x
    heads, g = seen.shape[1], x.shape[1]
    if heads not in (1, g):
        seen = seen.unflatten(1, (g, heads // g)).any(2)
    return x.masked_fill(~seen[..., None], 0)
