"""The engine core's stage logic, no sockets: form a batch, route, sample, gather, run the model, write out (``EngineCore.step()``), and its factory (``build.py``)."""
