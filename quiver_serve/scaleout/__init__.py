"""Scale-out: the engine as Ray Serve replicas (``ray_serve.py``), driven in-process (``local_engine.py``)."""
