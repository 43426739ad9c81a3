"""The allocator's RPC: an authenticated JSON-lines protocol over TCP.

- ``protocol``: the wire (framing, handshake, error codes; the module's docstring is the
  protocol's description), the errors a handler raises and the client sees, addresses.
- ``client``: ``RpcClient``, blocking and thread-safe, with its retry policy.
- ``server``: ``RpcServer``, an event loop (uvloop) in a thread, and the modules it is
  made of: ``connection``, ``pool`` (connections in their handshake), ``handshake``,
  ``dispatch`` (handlers, grouped ops).

Import each name from the module that holds it. This package imports none of them, so
what runs inside jobs (the shim, the worker API) loads the client and the protocol only:
no server code, no event loop (``tests/unit/test_rpc.py`` checks it). The package logs
under the one name ``herd_operator.rpc``.
"""
