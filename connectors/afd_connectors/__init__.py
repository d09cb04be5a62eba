"""Built-in AFD connectors, one subpackage per transport with its native sources beside it: ``zmq``, ``p2p``,
``shm``, ``cam``. They use only the public ``afd_sdk`` API and register through the ``afd_register_connectors``
hook like any third-party package (``plugin``); ``native`` loads their optional compiled modules."""

import afd_sdk  # noqa: F401  (installs the aliases of this package's moved modules: afd_sdk._compat)
