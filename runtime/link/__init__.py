"""The request/reply link (issue 33, being built in stages; docs/dev/link-plan.md B0).

Torch-free; imports only ``runtime.core`` and ``runtime.transport`` of the project, and is
imported by ``runtime.client``, ``runtime.serving``, ``supervisor`` and ``workers``. Importing
the subpackage loads none of its modules.

The messages of each link, defined once: ``client_protocol`` (client <-> server, docs/protocol.md)
and ``rank_protocol`` (engine <-> ranks). ``pending`` (PendingTable, the one table of requests in
flight). The client's end (S5): ``link`` (``Link``, ``LinkOptions``), over ``dealer`` (the DEALER, read
by its caller), ``awaited`` (its requests in flight and what each reply does), ``session`` (its shared
memory), ``handshake`` (the monitor's verdicts) and ``link_thread`` (``LinkThread``).
"""
