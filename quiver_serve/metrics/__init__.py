"""Metrics (DESIGN §5): the observer hooks the pipeline calls (``observer.py``) and their Prometheus side, multiprocess (``prometheus.py``)."""
