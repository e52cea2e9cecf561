"""The front door: HTTP (FastAPI, the hot routes answered in the HTTP protocol), KServe v2 and
gRPC, in one or several front-end processes."""
