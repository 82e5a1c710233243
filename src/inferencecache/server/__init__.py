"""The gRPC server, its HTTP surfaces and ``inferencecache serve``."""
