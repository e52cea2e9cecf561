"""PyG models: built from the config and loaded weights-only (``served.py``), their fast forward (``fast.py``), exact GCN normalisation (``exact_gcn.py``) and CUDA graphs (``graphed.py``)."""
