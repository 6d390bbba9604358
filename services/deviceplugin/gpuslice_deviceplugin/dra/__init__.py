"""The node agent in DRA mode: ResourceSlices, kubelet's DRA plugin API, claims."""
