"""Front door: HTTP/gRPC cost per request, the headline run against the PyG-style baseline."""
