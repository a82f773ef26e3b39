"""packkit: pack variable-length examples into fixed windows for fine-tuning."""

__version__ = "0.1.0"
