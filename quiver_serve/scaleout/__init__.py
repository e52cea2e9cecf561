"""Scale-out: the engine as Ray Serve replicas (``ray_serve.py``), each driven in-process
(``engine/client/local.py``)."""
