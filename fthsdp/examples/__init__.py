"""The example trainer: a small GPT-style model on synthetic data it can visibly learn."""
