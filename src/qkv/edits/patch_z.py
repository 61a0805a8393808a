"""Head-output patching: a head's ``z`` at some query rows replaced by one recorded elsewhere.

Shape legend: ``b`` batch (any leading dims), ``h`` query heads, ``i`` query length, ``e``
value size; ``H`` and ``R`` the number of patched heads and rows.

The activation patching of a head's output (Vig et al. 2020; Wang et al. 2022's IOI
circuit; TransformerLens' ``patching.get_act_patch_attn_head_out_by_pos``, a hook on
``hook_z``): run a model on a corrupted input with one head's output at some positions
taken from a clean run, for each patched head ``n`` and row ``r``::

    z[..., n, r, :] = given[..., r, n, :]

``given (..., R, H, e)`` is in ``hook_z``'s ``[batch, pos, head, d_head]`` order, so a
``qkv.record`` entry of the clean run, recorded with the same ``heads`` and ``rows``, goes in
as it is. Where :class:`~qkv.edits.PatchPattern` keeps the corrupted run's values and moves
only the weights, this moves the head's whole output; every later layer reads it as the
run's own. The call itself runs on qkv's engines unchanged, its weights as computed (what
a recording shows in ``hook_pattern``). A per-position mean (a mean ablation over the batch
alone) is this edit with that mean as ``given``.

Patching every head of every layer with the clean run's ``z`` does not give the clean run's
output unless the two inputs differ only inside attention: the embeddings and the MLPs still
read the corrupted residual stream. Rows count within each call, as ``qkv.record``'s do (a
``generate()`` decoding step has one).
"""

from __future__ import annotations

from torch import Tensor

from .base import Call, Edit, check_batch, check_patch, patched


class PatchZ(Edit):
    """Replace the output ``z`` of ``heads`` at query ``rows`` by ``z (..., R, H, e)``, in ``hook_z``'s order."""

    def __init__(self, heads, rows, z: Tensor):
        check_patch("PatchZ", heads, rows, "z", z, "(..., rows, heads, e), as hook_z records it")
        self.heads, self.rows, self.z = heads, rows, z

    def finish(self, call: Call, out: Tensor) -> Tensor:
        heads, rows = patched("PatchZ", self.heads, self.rows, call)
        expected = (len(rows), len(heads), out.shape[-1])
        if tuple(self.z.shape[-3:]) != expected:
            raise ValueError(
                f"PatchZ: z expected shape (..., {expected[0]}, {expected[1]}, {expected[2]}) (rows, heads, e), as "
                f"hook_z records it, got {tuple(self.z.shape)}; this call has {call.rows} query rows and "
                f"{call.heads} heads (a generate() decoding step: 1 row)"
            )
        check_batch("PatchZ: z", self.z, call)
        given = self.z.to(device=out.device, dtype=out.dtype).transpose(-3, -2)  # (..., H, R, e)
        heads, rows = heads.to(out.device), rows.to(out.device)
        out = out.clone()  # the caller's output stays as computed
        out[..., heads[:, None], rows[None, :], :] = given.expand(*out.shape[:-3], *given.shape[-3:])
        return out

    def __repr__(self) -> str:
        return f"PatchZ({self.heads!r}, {self.rows!r}, z{tuple(self.z.shape)})"
