"""The ``ckptstore`` command line."""
