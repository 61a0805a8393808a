"""What the engines share: tiles, the fused CPU kernel, tile arithmetic, dropout, sinks, weights.

Nothing here is an engine or a backend; each module is one piece the engines
(``backends.engines``) and the block-local backend (``backends.local``) build on:

==========================  ===========================================================
``tiles``                   a tile's bias, mask state and key range; live-tile iteration
``lse``                     the log-sum-exp of a row: the dead-row convention and merges
``flash_cpu``               PyTorch's private fused CPU kernel, behind a correctness probe
``tile_math``               in-place tile arithmetic (scratch buffers, exp, tanh)
``offset_profile``          a window mask and shift-invariant bias as one offset profile
``bias_grad``               the gradient of a learned offset profile (T5 buckets)
``additive_tiles``          the additive score's hand-written tile kernel
``dropout``                 dropout masks hashed from a seed and coordinates
``sinks``                   attention sinks on a row's ``(out, lse)``
``weights_from_lse``        attention weights rebuilt from the log-sum-exp, chosen rows only
``threads``                 independent tile tasks on Python threads
==========================  ===========================================================

Kept free of imports so that any backend module can import any of them.
"""
