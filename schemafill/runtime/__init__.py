"""What runs a model: the target model (``model``: layers, weights, the math of a forward), the
KV storage its calls read and write (``storage``), the call interface (``calls``), the backends
that execute calls (``backends/``) with the CPU products and kernels they use (``products``,
``kernels/``), the EAGLE-3 head (``drafter``), the response grammar a response's tokens are
chosen under (``grammar``), batched greedy generation (``generation``) and the head's
features on disk (``feature_cache``), precision and device policy (``precision``,
``device``, ``host``, ``host_cache``, ``timing``, ``allocator``), and loading a target onto its
backend (``loading``).

Direction inside: ``layers``, ``storage``, ``calls`` ← ``model`` ← ``backends`` ← ``loading``;
the model and storage never import a backend (``tests/test_architecture.py``). May import:
torch, transformers, safetensors and xgrammar, ``schemafill.contract``, ``schemafill.config`` and the
plumbing; never a stage.
"""
