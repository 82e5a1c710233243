"""gRPC client commands (``inferencecache lookup``)."""
