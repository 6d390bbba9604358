"""Per-node agent: kubelet device plugin, GPU discovery, Allocate from the ledger."""
