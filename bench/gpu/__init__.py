"""The GPU suites and their one runner: ``python -m bench.gpu <suite>`` (``__main__.py``)."""
