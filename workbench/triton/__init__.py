"""Triton: model repositories built from ModelConfig protobufs, a local server manager, and clients."""
