"""C kernels built for this host at first use and loaded through ctypes: ``batch_invariant``
(its source ``batch_invariant.c``), the batch-invariant backend's attention, norms and bf16
products. May import: torch and ``schemafill.runtime``'s host cache."""
