"""The tool-call contract every stage agrees on: what a request is (``toolcall``, its tool
schemas: ``schemas``), how a response is written and read (``response_format``, ``parser``),
when it stops (``stopping``), how a request becomes a prompt (``prompt``, ``tool_template``),
request files and their rejected records (``records``), multi-call compositions (``compose``)
and the quality of a response's calls (``callmetrics``).

It knows nothing of models or tensors. May import: the standard library and ``schemafill.atomic``.
"""
