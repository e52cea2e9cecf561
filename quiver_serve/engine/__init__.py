"""The serving engine: stage logic (``core/``), its processes (``procs/``) and the caller side (``client/``)."""
