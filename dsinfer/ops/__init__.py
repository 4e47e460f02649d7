"""Ops the models call, each a torch reference plus optional faster backends (see :mod:`dsinfer.ops.registry`)."""
