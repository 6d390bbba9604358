"""The local stack: gpuslice on one machine, with stand-ins for kubelet, the API
server and kube-scheduler that speak their real protocols."""
