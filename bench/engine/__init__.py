"""Engine core and daemon: pipeline efficiency, stage profile, model compute, latency traces."""
