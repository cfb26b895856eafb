"""Triton Python-backend model sources; each file is copied into a repository as `<model>/1/model.py`.

They run inside tritonserver (which provides `triton_python_backend_utils`), so they import nothing from the
workbench and read everything they need from their config parameters and version folder.
"""
