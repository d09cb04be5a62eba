"""CAMAsyncAFDConnector: routed-expert dispatch/combine; portable torch.distributed and Ascend backends."""
