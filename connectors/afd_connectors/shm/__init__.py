"""ShmAFDConnector: same-host shared-memory rings (C doorbell, C++ steady state, adaptive spin), raw ring."""
