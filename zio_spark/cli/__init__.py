"""The ``zio-spark`` command line: one module per command, ``main`` dispatches."""
