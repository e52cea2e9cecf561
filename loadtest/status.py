"""The statuses a load caller reports for one request (strings, so results from every protocol
count together): HTTP codes (``"200"``, ``"503"``), ``"grpc:<NAME>"`` (a gRPC status other than
OK), ``"timeout"``, ``"conn:<why>"`` (the connection failed or was cut), ``"stream:error"`` (a
``ModelStreamInfer`` answer with an ``error_message``). Only ``OK`` is a success: HTTP 200, and
gRPC status OK reported as ``"200"``."""

OK = "200"
