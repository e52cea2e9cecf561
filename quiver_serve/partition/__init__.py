"""Partitioning a graph across hosts, offline (docs/architecture.md, "Partitioning";
docs/decisions/0042-partitioning.md): the partition book (``book.py``), the per-partition data and
its snapshot folders (``data.py``), the assignment methods (``methods.py``), the replicated hot
rows (``hot.py``) and the command line (``python -m quiver_serve.partition``)."""
