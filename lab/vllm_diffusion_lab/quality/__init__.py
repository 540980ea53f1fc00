"""Evaluation corpora and scoring for measuring decoding quality."""
