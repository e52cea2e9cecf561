"""A graph partitioned across partition servers on a Ray cluster (docs/architecture.md,
"Partitioned serving"; decisions 0044, 0045)."""
