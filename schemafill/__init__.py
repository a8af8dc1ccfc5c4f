"""SchemaFill's core, which every stage imports and which imports no stage. Two rooms and the
plumbing beside them (docs/design.md, "Rooms"):

* ``contract/`` — the tool-call contract: requests, tool schemas, response formats, the
  incremental parser, the stopping rule, prompts, request files and call quality;
* ``runtime/`` — what runs a model: the target model, its KV storage, the backends that
  execute its calls and their kernels, the EAGLE-3 head, batched generation, precision and
  device policy, weights loading;
* plumbing: ``config`` (the configuration dataclasses), ``tracking`` (W&B), ``atomic`` (atomic
  files), ``fingerprint`` (stage caching).

Imports point down: runtime → config → contract → atomic; tracking → config; fingerprint → atomic.
"""
