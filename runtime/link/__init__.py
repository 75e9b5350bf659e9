"""The request/reply links (issue 33; docs/dev/link-plan.md B0 and its progress notes).

Torch-free; imports only ``runtime.core`` and ``runtime.transport`` of the project, and is
imported by ``runtime.client``, ``runtime.serving``, ``supervisor`` and ``workers``. Importing
the subpackage loads none of its modules.

The messages of each link, defined once: ``client_protocol`` (client <-> server, docs/protocol.md)
and ``rank_protocol`` (engine <-> ranks). ``pending`` (PendingTable, the one table of requests in
flight). The client's end (S5): ``link`` (``Link``, ``LinkOptions``), over ``dealer`` (the DEALER, read
by its caller), ``outbox`` (what the DEALER's holder sends, in order), ``awaited`` (its requests in
flight and what each reply does), ``handshake`` (the monitor's verdicts) and ``link_thread``
(``LinkThread``); ``reader`` (``ReaderRole``: who reads a socket, the waiting caller or the link
thread; the DEALER's holder and the supervisor's reader both). The same-host shared memory (S6):
``session`` (``ShmSession``, the same at both ends); the client's ``current_session``
(``CurrentSession``); the server's ``listener`` keeps one per client (``peer_shm``). The engine's end of a replica's ranks: ``broadcast`` (the shm ring every rank
reads; only the output rank answers, by its answer lane or ctl DEALER; ``supervisor.replica`` writes
it), ``rank_window`` (when queued requests go to the ring) and ``rank_answers`` (``Answers``: reading
what the ranks send).
"""
