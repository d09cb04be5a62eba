"""Built-in AFD connectors. They use only the public ``afd_sdk`` API and register
through the ``afd_register_connectors`` hook like any third-party package."""
