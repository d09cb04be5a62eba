"""ZmqAFDConnector: ZMQ transport (C wire on pyzmq's libzmq, C++ steady state) and its raw baseline."""
