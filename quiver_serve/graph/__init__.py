"""Graph data: the CSC type (``csc``) and the dataset loaders (``datasets``, needs the config)."""
