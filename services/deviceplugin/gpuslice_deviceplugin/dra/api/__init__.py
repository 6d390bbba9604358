"""kubelet's DRA plugin and plugin registration gRPC APIs, generated from the
.proto files beside this module (``make proto``)."""
