"""The KServe v2 gRPC port, on the daemon's own HTTP/2 (docs/decisions/0033-grpc-own-http2.md).

The pipeline, from the socket up:

* ``server.py``: the listening socket (``SO_REUSEPORT``) and its connections, drained on stop;
* ``connection.py``: one connection's frames in (RFC 9113), its streams, and the abuse limits
  that end it (``limits.py``, decision 0036); ``sending.py``: its frames out, within the
  client's windows; ``frames.py``: the frame API both use (numbers, encodings, HPACK);
* ``streams.py``: one call's stream (messages in, the answer and trailers out);
* ``calls.py``: which call a stream is (by ``:path``) and ``start()``; ``ModelInfer`` is
  answered inside the connection's callbacks, ``service.py`` has the other RPCs and
  ``stream_infer.py`` ``ModelStreamInfer``'s session;
* ``proto.py``: KServe's messages (built from data) and the hand-written answers;
  ``status.py``: gRPC status codes by name.
"""
