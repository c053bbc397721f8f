"""eagle-data: EAGLE-3 draft-model training data from a target model, as a Ray Data job."""

__version__ = "0.1.0"  # pyproject.toml reads it from here
