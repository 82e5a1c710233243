"""Generated protobuf and gRPC stubs of the inferencecache.v1alpha1 contract (never edit by hand)."""
