"""The request/reply link (issue 33, being built in stages; docs/dev/link-plan.md B0).

Torch-free; imports only ``runtime.core`` and ``runtime.transport`` of the project, and is
imported by ``runtime.client``, ``runtime.serving``, ``supervisor`` and ``workers``. Importing
the subpackage loads none of its modules.

So far (stage S1), the messages of each link, defined once:
``client_protocol`` (client <-> server, docs/protocol.md) and ``rank_protocol`` (engine <-> ranks).
"""
