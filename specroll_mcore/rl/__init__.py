"""GRPO pieces: data sources (the offline GSM8K-style generator for now)."""
