"""P2pNcclAFDConnector: torch.distributed P2P (NCCL on CUDA, Gloo on CPU), its C++ wire and raw baseline."""
