"""Metrics (docs/architecture.md, "Outside contracts"): the observer hooks the pipeline calls
(``observer.py``) and their Prometheus side, multiprocess (``prometheus.py``)."""
