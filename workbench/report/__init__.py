"""What a reader sees: the report page, its figures, the recommendation, the verdict lines and the notebooks'
parameters."""
