"""What a user runs: the ``specdec`` CLI, the local-stack launcher, the client, ``bench`` and
``selftest``, and the stub generator. The top layer."""
