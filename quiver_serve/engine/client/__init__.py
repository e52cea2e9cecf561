"""The caller side: the ZeroMQ clients (IO-thread and per-event-loop), the in-process driver, the front-end facade, ``Pipeline`` and the seed's stage API."""
