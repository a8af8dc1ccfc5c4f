"""The round loop every method runs and its steps: draft trees (``tree``, ``candidates``),
verification masks and each node's choice (``verify``), the commit step (``commit``), exact
sampling (``sampling``), a request's KV regions (``arena``), its session on the target
(``session``), its calls and their outputs (``call``), one forward over a round's calls
(``forward``), a request's options (``options``), the batch as one request prices it
(``share``), phases (``phases``), the decoder interface (``decoding``) and THE loop
(``loop``). The lowest room of ``infer``: imports only the core."""
