"""uniradix.kernels: gather/scatter of KV pages between the device pool and the host pool for
HiCache (Triton kernels with a torch reference).  Built with the host tier (issue 5)."""
