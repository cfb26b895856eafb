"""Triton: serving plans, model repositories (ModelConfig protobuf), the server's lifecycle, clients, the served
runner, deployment files, and the generation repositories with their Python-backend sources."""
