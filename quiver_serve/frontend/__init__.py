"""The front door: HTTP (FastAPI plus raw-ASGI hot routes), KServe v2 and gRPC, in one or several front-end processes."""
