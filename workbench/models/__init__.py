"""Models as their users load them: transformers and sentence-transformers loading, an embedding model's
sentence-transformers pipeline, and tiny random-weight models for tests and demos."""
